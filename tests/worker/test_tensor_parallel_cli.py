"""The worker's tensor-parallel flags: good values reach WorkerConfig, bad ones are
refused by argparse (exit 2) naming the flag and the problem."""

from __future__ import annotations

import pytest

from frontend.serve.cli import build_parser as serve_parser
from worker.__main__ import config_from_args


def test_the_flags_reach_the_config():
    c = config_from_args(["--device", "cpu", "--tensor-parallel-size", "2", "--rank", "1",
                          "--distributed-init-method", "tcp://10.0.0.5:29500", "--distributed-timeout", "12"])
    assert (c.tensor_parallel_size, c.rank, c.distributed_init_method, c.distributed_timeout_s) == (2, 1, "tcp://10.0.0.5:29500", 12.0)
    d = config_from_args(["--device", "cpu"])
    assert (d.tensor_parallel_size, d.rank, d.distributed_init_method) == (1, None, None)


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--tensor-parallel-size", "0"], "--tensor-parallel-size must be positive, got 0"),
        (["--tensor-parallel-size", "2", "--rank", "2", "--distributed-init-method", "tcp://h:1"], "--rank 2 is outside 0..1"),
        (["--tensor-parallel-size", "2", "--rank", "1"], "--rank needs --distributed-init-method"),
        (["--tensor-parallel-size", "2", "--distributed-init-method", "env://"], "expected tcp://HOST:PORT"),
        (["--tensor-parallel-size", "2", "--distributed-init-method", "tcp://host"], "expected tcp://HOST:PORT"),
        (["--distributed-timeout", "0"], "--distributed-timeout must be positive"),
        (["--tensor-parallel-size", "2", "--distributed-timeout", "10"], "--distributed-timeout 10 must be longer than --scheduler-timeout 10"),
    ],
)
def test_bad_values_are_named(capsys, argv, words):
    with pytest.raises(SystemExit) as e:
        config_from_args(["--device", "cpu", *argv])
    assert e.value.code == 2
    assert words in " ".join(capsys.readouterr().err.split())


def test_kvpool_serve_takes_the_flag_and_refuses_zero(capsys):
    assert serve_parser().parse_args(["serve", "m", "-tp", "2"]).tensor_parallel_size == 2
    from frontend.serve.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "/nonexistent", "--tensor-parallel-size", "0"])
    assert e.value.code == 2
    assert "--tensor-parallel-size must be positive, got 0" in capsys.readouterr().err


def test_the_ranks_rank_0_starts_profile_the_same_step(monkeypatch):
    # Every rank sizes its KV cache from the same profiled step: rank 0's argv, flags included.
    from worker.parallel import rank_group

    started = []

    class Recorded:
        def __init__(self, cmd, **_kw):
            started.append(cmd)
            self.pid = 0

    monkeypatch.setattr(rank_group.subprocess, "Popen", Recorded)
    argv = ["--device", "cpu", "--tensor-parallel-size", "3", "--max-num-batched-tokens", "1024", "--max-num-seqs", "8"]
    rank_group.LocalRanks(argv, 3, "tcp://127.0.0.1:29500", 1)
    assert len(started) == 2
    for r, cmd in enumerate(started, start=1):
        c = config_from_args(cmd[cmd.index("worker") + 1 :])
        assert (c.rank, c.max_num_batched_tokens, c.max_num_seqs) == (r, 1024, 8)
