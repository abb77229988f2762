"""``python -m worker`` at its edges: refused, unreachable, stopped, over budget, its HTTP.

Real worker processes against a ROUTER socket in the test; every wait is bounded and
every process is killed in a finally.
"""

from __future__ import annotations

import os
import signal
import subprocess
import urllib.error
import urllib.request

import pytest
from kvtest.fake_scheduler import STARTUP_S, FakeScheduler, free_port
from kvtest.worker_proc import worker_process

from protocol.worker_messages import (
    Heartbeat,
    Shutdown,
    WorkerExit,
    WorkerHello,
    WorkerReady,
)
from worker.scheduler_link import EXIT_REFUSED, EXIT_SCHEDULER_LOST

pytestmark = pytest.mark.e2e

def worker(endpoint: str, *extra: str):
    return worker_process(endpoint, *extra, dtype="float32")


def _stderr(proc: subprocess.Popen) -> str:
    return proc.communicate(timeout=10)[1]


def test_a_refused_worker_exits_4_with_the_reason():
    r = FakeScheduler()
    try:
        with worker(r.endpoint, "--http-port", "0") as proc:
            assert isinstance(r.recv(STARTUP_S, skip_heartbeats=False), WorkerHello)
            r.send(Shutdown("the worker serves another model"))
            assert proc.wait(timeout=15) == EXIT_REFUSED
            err = _stderr(proc)
            assert "refused by the scheduler" in err and "another model" in err
    finally:
        r.close()


def test_a_worker_that_never_reaches_its_scheduler_gives_up_after_its_timeout():
    port = free_port()  # nothing listens there
    with worker(f"tcp://127.0.0.1:{port}", "--http-port", "0", "--scheduler-timeout", "1") as proc:
        assert proc.wait(timeout=STARTUP_S + 30) == EXIT_SCHEDULER_LOST
        err = _stderr(proc)
        assert "no WorkerReady" in err and "--scheduler-timeout" in err and str(port) in err


def test_sigterm_tells_the_scheduler_and_exits_0():
    r = FakeScheduler()
    try:
        with worker(r.endpoint, "--http-port", "0") as proc:
            assert isinstance(r.recv(STARTUP_S, skip_heartbeats=False), WorkerHello)
            r.send(WorkerReady(64, 4, 4, 64))
            assert isinstance(r.recv(10, skip_heartbeats=False), Heartbeat)  # the acknowledgement
            proc.send_signal(signal.SIGTERM)
            assert isinstance(r.recv(10), WorkerExit)
            assert proc.wait(timeout=15) == 0
    finally:
        r.close()


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_http_serves_health_and_metrics_and_404_elsewhere():
    r, port = FakeScheduler(), free_port()
    try:
        with worker(r.endpoint, "--http-port", str(port)):
            assert isinstance(r.recv(STARTUP_S, skip_heartbeats=False), WorkerHello)
            status, body = _get(port, "/health")
            assert status == 503 and "not ready" in body
            r.send(WorkerReady(64, 4, 4, 64))
            assert isinstance(r.recv(10, skip_heartbeats=False), Heartbeat)
            assert _get(port, "/health") == (200, "ok\n")
            status, body = _get(port, "/metrics")
            assert status == 200 and "kvpool_worker_num_blocks" in body
            status, body = _get(port, "/anything")
            assert status == 404 and "kvpool_worker" not in body
            r.send(Shutdown())
    finally:
        r.close()


def test_num_gpu_blocks_override_above_the_budget_allocates_exactly_that_many():
    # 1MiB holds 128 blocks of this model at block size 4 in float32; vLLM sizes its cache to the override
    r = FakeScheduler()
    try:
        with worker(r.endpoint, "--http-port", "0", "--num-gpu-blocks-override", "1000") as proc:
            hello = r.recv(STARTUP_S, skip_heartbeats=False)
            assert isinstance(hello, WorkerHello) and hello.num_blocks == 1000
            proc.kill()
    finally:
        r.close()


def test_num_gpu_blocks_override_over_the_host_memory_is_refused_before_hello_naming_the_flag():
    per_block = 2 * 4 * 4 * 2 * 32 * 4  # K and V, 4 layers, block size 4, 2 KV heads of 32, float32
    n = 2 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // per_block  # twice the host's memory
    r = FakeScheduler()
    try:
        with worker(r.endpoint, "--http-port", "0", "--num-gpu-blocks-override", str(n)) as proc:
            assert proc.wait(timeout=STARTUP_S + 30) == 2
            err = _stderr(proc)
            assert f"cannot allocate the KV cache ({n} blocks of {per_block} bytes)" in err, err
            assert "available; lower --num-gpu-blocks-override" in err, err
            assert not r.sock.poll(0), "the worker said hello with memory it does not have"
    finally:
        r.close()


def test_a_kv_budget_over_the_device_memory_is_refused_before_hello():
    r = FakeScheduler()
    try:
        with worker(r.endpoint, "--http-port", "0", "--kv-cache-memory", "1000TiB") as proc:
            assert proc.wait(timeout=STARTUP_S + 30) == 2
            err = _stderr(proc)
            assert "cannot allocate the KV cache" in err and "available" in err and "--kv-cache-memory" in err
            assert not r.sock.poll(0), "the worker said hello with memory it does not have"
    finally:
        r.close()
