"""The client against an in-test fake scheduler (zmq ROUTER on a random port)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from kvtest.ports import free_port

from loadgen.client import KVPoolClient
from loadgen.datasets import shared_prefix_requests
from loadgen.request_result import SchedulerUnreachable
from loadgen.runner import run_benchmark


def _run(coro, bound=30):
    return asyncio.run(asyncio.wait_for(coro, bound))



def test_generate_streams_tokens(fake_scheduler_factory, expected_tokens):
    sched = fake_scheduler_factory()

    async def go():
        async with KVPoolClient(sched.address) as client:
            await client.connect(5)
            return await asyncio.gather(
                *(client.generate(i, f"t-{i}", [2, 3, 4 + i], 5, True, 5) for i in range(4))
            )

    results = _run(go())
    for i, r in enumerate(results):
        assert r.success and r.finish_reason == "length" and r.error is None
        assert r.token_ids == expected_tokens([2, 3, 4 + i], 5)
        assert len(r.itl_s) == 2  # chunks [1], [2], [2]: two gaps after the first
        assert 0 <= r.ttft_s <= r.latency_s
        assert r.num_cached_tokens == 16
    assert [m.ignore_eos for m in sched.received] == [True] * 4
    assert sorted(m.request_id for m in sched.received) == [f"t-{i}" for i in range(4)]


def test_rejection_abort_and_silence(fake_scheduler_factory):
    sched = fake_scheduler_factory(lambda i: {1: "reject", 2: "silent", 3: "abort"}.get(i, "ok"))

    async def go():
        async with KVPoolClient(sched.address) as client:
            await client.connect(5)
            return await asyncio.gather(
                *(client.generate(i, f"t-{i}", [5] * 8, 3, False, 0.5) for i in range(4))
            )

    ok, rejected, silent, aborted = _run(go())
    assert ok.success
    assert not rejected.success and "prompt too long" in rejected.error
    assert not silent.success and "no response" in silent.error
    assert not aborted.success and aborted.finish_reason == "abort"
    deadline = time.monotonic() + 5
    while "t-2" not in sched.aborted and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sched.aborted == ["t-2"]  # the silent request was aborted at the scheduler


def test_unreachable_raises_at_its_connect_timeout():
    port = free_port()

    async def go():
        async with KVPoolClient(f"tcp://127.0.0.1:{port}") as client:
            await client.connect(1.0)

    # NOTE: no timed assertion: a hang would end in the 60 s bound's TimeoutError,
    # not in SchedulerUnreachable naming the 1 s connect timeout.
    with pytest.raises(SchedulerUnreachable, match=f"127.0.0.1:{port}: no connection within 1 s"):
        _run(go(), bound=60)


def test_runner_concurrency_and_overall_timeout(fake_scheduler_factory):
    sched = fake_scheduler_factory(lambda i: "silent" if i >= 3 else "ok")
    reqs = shared_prefix_requests(6, 2, 16, 4, 4)

    outcome = _run(
        run_benchmark(
            reqs,
            np.zeros(6),
            scheduler=sched.address,
            metrics_url=None,
            ignore_eos=True,
            max_concurrency=2,
            request_timeout=60,
            timeout=1.0,
        )
    )
    assert outcome.timed_out
    assert [r.success for r in outcome.results] == [True] * 3 + [False] * 3
    assert all("--timeout" in r.error for r in outcome.results[3:])
    # At least the 1 s --timeout; far less than the 60 s request timeout (a generous
    # bound for a loaded 2-core machine: what ended the run was --timeout).
    assert 1.0 <= outcome.duration_s < 30
    deadline = time.monotonic() + 5
    while len(sched.aborted) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    # the two in flight (concurrency 2) were aborted; the sixth never got a slot
    assert sorted(sched.aborted) == sorted(r.request_id for r in outcome.results[3:5])
