"""``python -m worker``'s external-tier flags (worker/arg_checks.py check_external_tier): each
backend's flags name what it needs and nothing of another's, exit 2 naming the flag; good
ones reach WorkerConfig."""

from __future__ import annotations

import pytest

from worker.__main__ import config_from_args

CPU = ["--device", "cpu"]
DISK = ["--kv-offloading-backend", "disk"]
MOONCAKE = ["--mooncake-master", "127.0.0.1:50051", "--mooncake-metadata", "http://127.0.0.1:8080/metadata"]


def test_the_disk_tier_reaches_the_config(tmp_path):
    c = config_from_args([*CPU, *DISK, "--kv-offloading-path", str(tmp_path), "--kv-offloading-disk-size", "0.5"])
    assert (c.kv_offloading_backend, c.kv_offloading_path, c.kv_offloading_disk_bytes) == ("disk", str(tmp_path), 2**29)
    c = config_from_args(CPU)
    assert (c.kv_offloading_backend, c.kv_offloading_path, c.kv_offloading_disk_bytes) == ("", None, 0)
    c = config_from_args([*CPU, "--kv-offloading-backend", "mooncake", *MOONCAKE])
    assert (c.kv_offloading_backend, c.mooncake_master) == ("mooncake", "127.0.0.1:50051")


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (DISK, "--kv-offloading-backend disk needs --kv-offloading-path DIR"),
        ([*DISK, "--kv-offloading-disk-size", "1"], "--kv-offloading-backend disk needs --kv-offloading-path DIR"),
        ([*DISK, "--kv-offloading-path", "/tmp/x"], "and --kv-offloading-disk-size GIB (> 0)"),
        ([*DISK, "--kv-offloading-path", "/tmp/x", "--kv-offloading-disk-size", "0"], "and --kv-offloading-disk-size GIB (> 0)"),
        (["--kv-offloading-path", "/tmp/x"], "--kv-offloading-path and --kv-offloading-disk-size are for --kv-offloading-backend disk, not native"),
        ([*DISK, "--kv-offloading-path", "/tmp/x", "--kv-offloading-disk-size", "1", *MOONCAKE],
         "--mooncake-master and --mooncake-metadata are for --kv-offloading-backend mooncake, not disk"),
        (["--mooncake-master", "h:1"], "are for --kv-offloading-backend mooncake, not native"),
        (["--kv-offloading-backend", "mooncake", "--mooncake-master", "h:1"], "mooncake needs --mooncake-master HOST:PORT and --mooncake-metadata URL"),
        ([*DISK, "--kv-offloading-path", "/tmp/x", "--kv-offloading-disk-size", "1", "--tensor-parallel-size", "2"],
         "--kv-offloading-backend disk: not with tensor parallelism yet"),
        (["--kv-offloading-backend", "mooncake", *MOONCAKE, "--tensor-parallel-size", "2"], "--kv-offloading-backend mooncake: not with tensor parallelism yet"),
        (["--kv-offloading-backend", "s3"], "--kv-offloading-backend s3: LMCache is not supported"),
    ],
    ids=["disk-alone", "disk-no-path", "disk-no-size", "disk-size-0", "path-without-disk", "mooncake-flags-with-disk",
         "mooncake-flags-without-mooncake", "mooncake-no-metadata", "disk-tp2", "mooncake-tp2", "unknown-backend"],
)
def test_bad_external_tier_flags_exit_2_naming_them(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        config_from_args([*CPU, *argv])
    assert e.value.code == 2
    assert words in " ".join(capsys.readouterr().err.split())
