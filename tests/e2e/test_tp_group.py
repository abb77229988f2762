"""A tensor-parallel worker group (``python -m worker --tensor-parallel-size 2``, gloo on
CPU) behind a real scheduler: its greedy float64 tokens are transformers' own; one rank
SIGKILLed mid-run takes the group down at once, the scheduler recomputes its requests on
the next group and every request ends with the tokens of an uninterrupted run; ranks
that disagree, or a model that cannot be split, are refused with a clear error."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kvtest.cluster import ROOT, Cluster, free_port
from kvtest.hf_models import reference_generate
from kvtest.tp_ranks import rank_pids

from protocol.client_messages import EngineCoreOutputs, Generate

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TP2 = ["--dtype", "float64", "--tensor-parallel-size", "2", "--kv-cache-memory", "8MiB"]


def _wait(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"{what} not within {timeout} s"
        time.sleep(0.05)


def test_a_killed_rank_takes_its_group_down_and_costs_no_request(tmp_path, tiny_reference):
    rng = random.Random(5)
    reqs = [Generate(f"t{i}", [rng.randrange(2, 512) for _ in range(12 + 9 * i)], 40, ignore_eos=True) for i in range(3)]
    expected = {g.request_id: reference_generate(tiny_reference, g.prompt_token_ids, g.max_tokens) for g in reqs}
    # NOTE: transformers' greedy float64 tokens are an uninterrupted run's: two ranks give
    # them (test_ranks_started_by_hand_..., tests/worker/parallel/test_tensor_parallel.py).
    with Cluster(["--worker-reconnect-timeout", "60"], TP2, log_dir=tmp_path) as c:
        leader = c.procs["worker"]
        ranks = rank_pids(leader.pid)
        assert list(ranks) == [1]
        sock = c.client()
        try:
            for g in reqs:
                sock.send(c.codec.encode(g))
            got: dict[str, list[int]] = {g.request_id: [] for g in reqs}
            done: set[str] = set()

            def pump(until) -> None:
                deadline = time.monotonic() + 120
                while not until():
                    assert time.monotonic() < deadline, "requests stalled"
                    if sock.poll(200):
                        frame = c.codec.decode(sock.recv())
                        assert isinstance(frame, EngineCoreOutputs), frame
                        for msg in frame.outputs:
                            got[msg.request_id].extend(msg.new_token_ids)
                            if msg.finished:
                                done.add(msg.request_id)

            pump(lambda: all(len(t) >= 3 for t in got.values()))
            assert not done, "the requests finished before a rank could be killed"
            os.kill(ranks[1], signal.SIGKILL)
            # Rank 0's next collective fails: it tells the scheduler and exits 5 (the
            # bound is for a loaded 2-core machine, not a speed figure).
            assert leader.wait(20) == 5
            _wait(lambda: c.health() == 503, 10, "/health 503 after the group went down")
            c.spawn_worker("worker2")
            c.wait_healthy(60)
            pump(lambda: len(done) == len(reqs))
        finally:
            sock.close(linger=0)
    assert got == expected
    log = (tmp_path / "worker.log").read_text()
    assert "tensor-parallel group lost" in log


def _worker(*args: str, log: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "worker", "--scheduler", f"tcp://127.0.0.1:{free_port()}", "--device", "cpu",
            "--http-port", "0", "--distributed-timeout", "20", *args]
    return subprocess.Popen(argv, cwd=ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT)


def _finish(procs: list[subprocess.Popen], timeout: float = 60) -> list[int]:
    try:
        return [p.wait(timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)


def test_ranks_that_disagree_on_the_group_size_are_refused(tmp_path):
    url = f"tcp://127.0.0.1:{free_port()}"
    r0 = _worker("--tensor-parallel-size", "2", "--rank", "0", "--distributed-init-method", url, log=tmp_path / "r0.log")
    r1 = _worker("--tensor-parallel-size", "3", "--rank", "1", "--distributed-init-method", url, log=tmp_path / "r1.log")
    assert _finish([r0, r1]) == [2, 2]
    for name in ("r0.log", "r1.log"):
        text = (tmp_path / name).read_text()
        assert "tensor-parallel group refused: rank 1 has world_size 3, rank 0 has 2" in text, text[-2000:]


def test_a_model_whose_heads_do_not_split_is_refused(tmp_path):
    # The tiny checkpoint has 8 query heads and 2 KV heads: 3 ranks cannot share them.
    (code,) = _finish([_worker("--tensor-parallel-size", "3", log=tmp_path / "w.log")])
    text = (tmp_path / "w.log").read_text()
    assert code == 2
    assert "num_attention_heads 8 is not divisible by --tensor-parallel-size 3" in text, text[-2000:]
    assert "started ranks" not in text  # refused before any other rank was started


def test_two_ranks_with_the_host_tier_load_revisited_prefixes_and_keep_their_tokens(tmp_path, tiny_reference):
    # Each rank offloads and loads the blocks of its own KV heads: a revisited prefix
    # loaded from host memory must give the tokens it gave when computed.
    rng = random.Random(2)
    prefixes = [[rng.randrange(2, 512) for _ in range(64)] for _ in range(4)]
    reqs = [Generate(f"r{r}-p{p}", prefixes[p] + [rng.randrange(2, 512) for _ in range(3)], 6, ignore_eos=True)
            for r in range(2) for p in range(4)]
    sched = ["--num-gpu-blocks-override", "12", "--max-num-seqs", "1", "--kv-offloading-size", "0.002"]
    with Cluster(sched, [*TP2, "--kv-offloading-size", "0.002"], log_dir=tmp_path) as c:
        for g in reqs:
            r = c.generate([g], timeout=60)[g.request_id]
            assert r.error is None and r.token_ids == reference_generate(tiny_reference, g.prompt_token_ids, 6, True), g.request_id
        m = c.metrics()
    assert m["kvpool_kv_offload_loaded_blocks_total"] >= 4 * 4


def test_ranks_started_by_hand_form_a_group_and_the_pool_is_the_smallest_rank(tmp_path, tiny_reference):
    # As on several hosts: each rank its own command, one --distributed-init-method; rank
    # 1's budget is half rank 0's, so the pool is rank 1's count. Each rank's block holds
    # one of the tiny checkpoint's 2 KV heads: 2 x 4 layers x 1 x 32 x 16 tokens x 4 bytes.
    per_rank_block = 2 * 4 * 1 * 32 * 16 * 4
    url = f"tcp://127.0.0.1:{free_port()}"
    group = ["--dtype", "float64", "--tensor-parallel-size", "2", "--distributed-init-method", url]
    with Cluster(start_worker=False, log_dir=tmp_path) as c:
        c.spawn_worker("rank0", [*group, "--rank", "0", "--kv-cache-memory", "8MiB"])
        c.spawn_worker("rank1", [*group, "--rank", "1", "--kv-cache-memory", "4MiB"])
        c.wait_healthy(90)
        assert c.metrics()["kvpool_num_gpu_blocks"] == 4 * 2**20 // (2 * per_rank_block)  # float64: twice the bytes
        g = Generate("h", list(range(2, 40)), 12, ignore_eos=True)
        assert c.generate([g])["h"].token_ids == reference_generate(tiny_reference, g.prompt_token_ids, 12)
        # Rank 0 killed: rank 1 (not its child here) finds out from its next broadcast,
        # at the latest rank 0's keepalive, and exits 5, well inside --distributed-timeout.
        c.procs["rank0"].send_signal(signal.SIGKILL)
        assert c.procs["rank1"].wait(20) == 5
    assert "the tensor-parallel group is lost" in (tmp_path / "rank1.log").read_text()
