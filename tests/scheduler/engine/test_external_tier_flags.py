"""The scheduler's external tier: its flags (scheduler/engine/arg_checks.py check_external_tier,
exit 2 naming the flag), the tier it builds from them, and the check of each worker's hello
against them (scheduler/engine/external_setup.py): both processes must name the same tier."""

from __future__ import annotations

import pytest

from protocol.worker_messages import WorkerHello
from scheduler.core.offload.external_tier import ExternalTier, KnownKeys
from scheduler.engine.args import config_from_args
from scheduler.engine.external_setup import check_external_tier, make_external_tier
from scheduler.engine.worker_checks import WorkerRefused

DISK = ["--kv-offloading-backend", "disk"]
MOONCAKE = ["--mooncake-master", "127.0.0.1:50051", "--mooncake-metadata", "http://127.0.0.1:8080/metadata"]


def test_the_backend_reaches_the_config(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert config_from_args([]).kv_offloading_backend == "native"
    c = config_from_args(DISK)  # kvpool's own hashes are seeded by a constant: no PYTHONHASHSEED needed
    assert (c.kv_offloading_backend, c.prefix_caching_hash_algo) == ("disk", "kvpool_sha256")
    assert config_from_args([*DISK, "--prefix-caching-hash-algo", "kvpool_xxhash"]).kv_offloading_backend == "disk"
    c = config_from_args(["--kv-offloading-backend", "mooncake", *MOONCAKE])
    assert (c.kv_offloading_backend, c.mooncake_master, c.mooncake_metadata) == ("mooncake", "127.0.0.1:50051", "http://127.0.0.1:8080/metadata")


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        ([*DISK, "--no-enable-prefix-caching"], "--kv-offloading-backend disk needs the prefix cache"),
        (["--kv-offloading-backend", "mooncake", *MOONCAKE, "--no-enable-prefix-caching"], "--kv-offloading-backend mooncake needs the prefix cache"),
        (["--kv-offloading-backend", "mooncake", "--mooncake-master", "h:1"], "mooncake needs --mooncake-master HOST:PORT and --mooncake-metadata URL"),
        ([*DISK, *MOONCAKE], "are for --kv-offloading-backend mooncake, not disk"),
        (MOONCAKE, "--mooncake-master and --mooncake-metadata are for --kv-offloading-backend mooncake"),
    ],
    ids=["disk-no-prefix-cache", "mooncake-no-prefix-cache", "mooncake-no-metadata", "mooncake-flags-with-disk", "mooncake-flags-native"],
)
def test_bad_flags_exit_2_naming_them(argv, words, capsys, monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "0")  # so that only the flag at fault is refused
    with pytest.raises(SystemExit) as e:
        config_from_args(argv)
    assert e.value.code == 2 and words in " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
def test_vllm_hashes_need_pythonhashseed(algo, capsys, monkeypatch):
    """vLLM's xxhash hashes are seeded with random bytes without PYTHONHASHSEED: nothing saved would be found again."""
    argv = [*DISK, "--prefix-caching-hash-algo", algo]
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with pytest.raises(SystemExit) as e:
        config_from_args(argv)
    err = " ".join(capsys.readouterr().err.split())
    assert e.value.code == 2 and "PYTHONHASHSEED" in err and f"--prefix-caching-hash-algo {algo}" in err
    assert config_from_args([*argv[2:]]).prefix_caching_hash_algo == algo  # without the tier: fine
    monkeypatch.setenv("PYTHONHASHSEED", "42")
    c = config_from_args(argv)
    assert (c.kv_offloading_backend, c.prefix_caching_hash_algo) == ("disk", algo)


def test_the_tier_built_from_the_flags():
    assert make_external_tier("native", 16, None, None) is None
    tier = make_external_tier("disk", 16, None, None)
    assert isinstance(tier, ExternalTier) and isinstance(tier.index, KnownKeys)
    assert (tier.backend, tier.block_size, tier.identity) == ("disk", 16, "")
    with pytest.raises(ValueError, match="unknown --kv-offloading-backend 's3'"):
        make_external_tier("s3", 16, None, None)


def hello(**kw) -> WorkerHello:
    return WorkerHello(rank=0, world_size=1, num_blocks=100, block_size=16, vocab_size=512, eos_token_id=1, **kw)


def test_a_worker_with_the_same_tier_is_taken():
    check_external_tier(hello(), "native")
    check_external_tier(hello(external_tier="disk", external_identity="ab" * 16, external_keys=["cd" * 20]), "disk")
    check_external_tier(hello(external_tier="mooncake", external_identity="ab" * 16), "mooncake")


@pytest.mark.parametrize(
    ("kw", "backend", "words"),
    [
        ({}, "disk", "the worker's external KV tier is none, this scheduler's --kv-offloading-backend is disk"),
        ({"external_tier": "disk", "external_identity": "ab" * 16}, "native", "the worker's external KV tier is disk, this scheduler's --kv-offloading-backend is native"),
        ({"external_tier": "mooncake", "external_identity": "ab" * 16}, "disk", "the worker's external KV tier is mooncake, this scheduler's --kv-offloading-backend is disk"),
        ({"external_tier": "disk", "external_identity": ""}, "disk", "identity '' is not 32 hex digits"),
        ({"external_tier": "disk", "external_identity": "ab" * 8}, "disk", "is not 32 hex digits"),
    ],
    ids=["worker-none", "scheduler-native", "other-backend", "no-identity", "short-identity"],
)
def test_a_worker_with_another_tier_is_refused(kw, backend, words):
    with pytest.raises(WorkerRefused) as e:
        check_external_tier(hello(**kw), backend)
    assert words in str(e.value)
    if "32 hex digits" not in words:
        assert "give both the same --kv-offloading-backend" in str(e.value)
