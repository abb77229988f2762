"""The scheduler at its edges: a taken HTTP port, a full waiting queue, a worker that
leaves cleanly, a pool that cannot be reset after a loss.

Real scheduler processes (kvtest.scheduler_harness) except the last, in-process.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import time

import pytest
from kvtest.cluster import free_port as cluster_free_port
from kvtest.replies import NoReply
from kvtest.scheduler_harness import (
    REPO,
    Setup,
    expected_tokens,
    free_port,
    metric,
    prompt_of,
    tokens_of,
)

from protocol.client_messages import Generate, RequestError, TokenOutput
from protocol.worker_messages import WorkerHello
from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.engine.config import SchedulerConfig
from scheduler.engine.engine_core import EngineCore
from scheduler.sched.request import Request
from scheduler.sched.scheduler import Scheduler

pytestmark = pytest.mark.timeout(120)


@pytest.mark.e2e
def test_an_http_port_in_use_is_a_clear_error_not_a_traceback():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run(
            [sys.executable, "-m", "scheduler", "--port", str(free_port()), "--worker-port", str(free_port()),
             "--http-port", str(port)],
            cwd=REPO, capture_output=True, text=True, timeout=60,
        )
    assert r.returncode == 1
    assert "Traceback" not in r.stderr, r.stderr
    assert "cannot start" in r.stderr and f"127.0.0.1:{port}" in r.stderr and "--http-port" in r.stderr


@pytest.mark.e2e
def test_a_full_waiting_queue_refuses_with_a_request_error_and_changes_nothing():
    s = Setup("--max-num-seqs", "1", "--max-num-waiting", "2")
    try:
        s.worker.delay_s = 0.01
        s.client.send(Generate("run", prompt_of(1, 20), max_tokens=400, ignore_eos=True))
        assert isinstance(s.client.recv(), TokenOutput)  # running: the one seat is taken
        for i in range(2):
            s.client.send(Generate(f"wait{i}", prompt_of(2 + i, 20), max_tokens=2, ignore_eos=True))
        s.client.send(Generate("over", prompt_of(9, 20), max_tokens=2, ignore_eos=True))
        while isinstance(msg := s.client.recv(), TokenOutput):
            assert msg.request_id == "run"  # the two waiting requests wait
        assert isinstance(msg, RequestError) and msg.request_id == "over", msg
        assert "waiting queue is full" in msg.message and "--max-num-waiting" in msg.message
        s.worker.delay_s = 0.0
        done: set[str] = set()
        while len(done) < 3:
            msg = s.client.recv(10)
            assert isinstance(msg, TokenOutput), msg
            if msg.finished:
                done.add(msg.request_id)
        assert done == {"run", "wait0", "wait1"}
        # vLLM's admission counter (model_name and reason only, no engine label).
        m = s.sched.metrics()
        assert m['vllm:admission_rejections_total{model_name="test-model",reason="max_num_queued_reqs"}'] == 1
        assert m['vllm:admission_rejections_total{model_name="test-model",reason="max_num_queued_tokens"}'] == 0
    finally:
        s.close()


@pytest.mark.e2e
def test_a_worker_that_leaves_cleanly_is_not_an_error():
    s = Setup()
    try:
        s.worker.delay_s = 0.01
        s.client.send(Generate("r", prompt_of(3, 20), max_tokens=300, ignore_eos=True))
        assert isinstance(s.client.recv(), TokenOutput)
        s.worker.leave("SIGTERM")  # says goodbye, then nothing more
        s.sched.wait_health(503, bound_s=10)
        s.sched.proc.send_signal(signal.SIGTERM)
        assert s.sched.proc.wait(timeout=30) == 0
        log = s.sched.output()
        assert "ERROR" not in log, log  # (the harness logs at WARNING: INFO lines are not shown)
    finally:
        s.close()


def test_a_pool_that_still_holds_blocks_after_a_loss_stops_the_engine_loudly():
    config = SchedulerConfig(port=cluster_free_port(), worker_port=cluster_free_port(), http_port=cluster_free_port())

    async def main() -> None:
        engine = EngineCore(config)
        try:
            state = engine.state
            state.kv = KVCacheManager(16, 4, 64, enable_caching=False)
            state.scheduler = Scheduler(state.kv, 4, 64, 64)
            # A block held by something the scheduler does not know of (a leak).
            leaked = Request("leak", [5, 6, 7, 8, 9], 4)
            assert state.kv.allocate_slots(leaked, 5) is not None
            engine.worker.begin_handshake(b"w", WorkerHello(0, 1, 16, 4, 512, 1), 16)
            engine.worker.acknowledge(b"w")
            with pytest.raises(RuntimeError, match="still held"):
                engine.worker.lose("killed")
        finally:
            engine._close()

    asyncio.run(main())


@pytest.mark.e2e
def test_requests_arriving_while_the_worker_restarts_are_queued_and_served_by_the_next():
    s = Setup("--worker-reconnect-timeout", "30")
    try:
        assert s.client.generate("before", prompt_of(1, 20), max_tokens=3)[-1].finished
        s.worker.leave("SIGKILL")  # gone: the scheduler has a pool but no worker
        s.sched.wait_health(503, bound_s=10)
        for i in range(3):
            s.client.send(Generate(f"during{i}", prompt_of(10 + i, 20), max_tokens=4, ignore_eos=True))
        with pytest.raises(NoReply):
            s.client.recv(1.0)  # queued: no refusal, no tokens yet
        assert metric(s.sched.metrics(), "vllm:num_requests_waiting") == 3
        s.worker.close()
        s.start_worker()  # the restarted worker
        outs: dict[str, list[TokenOutput]] = {f"during{i}": [] for i in range(3)}
        while not all(o and o[-1].finished for o in outs.values()):
            msg = s.client.recv(10)
            assert isinstance(msg, TokenOutput), msg
            outs[msg.request_id].append(msg)
        for i in range(3):
            assert tokens_of(outs[f"during{i}"]) == expected_tokens(prompt_of(10 + i, 20), 4)
    finally:
        s.close()


@pytest.mark.e2e
def test_a_request_that_came_during_the_outage_gets_its_own_full_wait():
    s = Setup("--worker-reconnect-timeout", "3")
    try:
        s.worker.delay_s = 0.01
        s.client.send(Generate("early", prompt_of(1, 20), max_tokens=400, ignore_eos=True))
        assert isinstance(s.client.recv(), TokenOutput)
        s.worker.leave("SIGKILL")
        s.sched.wait_health(503, bound_s=10)
        lost = time.monotonic()
        time.sleep(2.0)
        s.client.send(Generate("late", prompt_of(2, 20), max_tokens=4, ignore_eos=True))
        errors = {}
        deadline = time.monotonic() + 15
        while len(errors) < 2 and time.monotonic() < deadline:
            try:
                msg = s.client.recv(0.5)
            except NoReply:
                continue
            if isinstance(msg, RequestError):
                errors[msg.request_id] = (time.monotonic() - lost, msg.message)
        assert set(errors) == {"early", "late"}, errors
        assert "no worker returned within 3 s" in errors["early"][1] and "no worker returned within 3 s" in errors["late"][1]
        # The early request waited its 3 s from the loss; the late one its own 3 s from its arrival.
        assert errors["late"][0] - errors["early"][0] > 1.0, errors
        assert errors["late"][0] >= 5.0, errors
    finally:
        s.close()


@pytest.mark.e2e
def test_a_worker_that_refuses_a_plan_is_told_to_stop_and_its_requests_wait_for_the_next():
    s = Setup()
    try:
        s.worker.refuse_plans = True
        s.client.send(Generate("r", prompt_of(4, 20), max_tokens=4, ignore_eos=True))
        assert s.worker.got_shutdown.wait(10), "the refusing worker was never told to stop"
        s.sched.wait_health(503, bound_s=10)
        s.worker.close()
        s.start_worker()  # its supervisor's restart
        outs = s.client.collect("r")
        assert tokens_of(outs) == expected_tokens(prompt_of(4, 20), 4)
    finally:
        s.close()
