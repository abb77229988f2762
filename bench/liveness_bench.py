"""The engine core under a burst: how long its worker goes without hearing from it.

A real ``python -m scheduler`` process on free loopback ports; a worker thread here
that only counts tokens (so the scheduler is the slow part); 8 decodes running, then
2,000 prompts of 2,000 tokens (each hashed on arrival) encoded first and sent at once.
The worker records the longest gap between two messages from the scheduler: before
the receive loops yielded, a burst kept the scheduler silent past the worker's timeout
(docs/benchmarks.md).

``python -m bench liveness`` prints the table.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import zmq

from bench.table import Row
from protocol.client_messages import (
    ClientRequest,
    ClientResponse,
    EngineCoreOutputs,
    Generate,
    RequestError,
)
from protocol.codec import Codec
from protocol.worker_messages import (
    Heartbeat,
    SchedulerToWorker,
    StepPlan,
    StepResult,
    WorkerHello,
    WorkerReady,
    WorkerToScheduler,
)

REPO = Path(__file__).resolve().parents[1]
NUM_BURST, BURST_LEN, NUM_DECODES, DECODE_TOKENS = 2000, 2000, 8, 1500
GAP_TARGET_S = 0.5  # one heartbeat interval; the worker gives up after 10 s


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _CountingWorker(threading.Thread):
    """Tracks each row's token counts, samples token 7, records the longest silence."""

    def __init__(self, ctx: zmq.Context, address: str):
        super().__init__(daemon=True)
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.max_gap_s, self.readies = 0.0, 0
        self.stop = threading.Event()

    def run(self) -> None:
        out, inp = Codec(WorkerToScheduler), Codec(SchedulerToWorker)
        rows: dict[int, list[int]] = {}
        self.sock.send(out.encode(WorkerHello(0, 1, 4096, 16, 512, 1)))
        last_heard = last_sent = None
        while not self.stop.is_set():
            if last_sent is not None and time.monotonic() - last_sent > 0.3:
                self.sock.send(out.encode(Heartbeat(time.time())))
                last_sent = time.monotonic()
            if not self.sock.poll(50):
                continue
            msg = inp.decode(self.sock.recv())
            now = time.monotonic()
            if last_heard is not None:
                self.max_gap_s = max(self.max_gap_s, now - last_heard)
            last_heard = now
            if isinstance(msg, WorkerReady):
                self.readies += 1
                self.sock.send(out.encode(Heartbeat(time.time())))
                last_sent = time.monotonic()
            elif isinstance(msg, StepPlan):
                for sid in (*msg.finished_seq_ids, *msg.preempted_seq_ids):
                    rows.pop(sid, None)
                for row in (*msg.new_rows, *msg.resumed_rows):
                    rows[row.seq_id] = [len(row.token_ids), row.num_computed_tokens]
                seq_ids = []
                for sid, r in rows.items():
                    r[1] += msg.num_scheduled_tokens.get(sid, 1)
                    if r[1] == r[0]:
                        r[0] += 1
                        seq_ids.append(sid)
                self.sock.send(out.encode(StepResult(msg.step_id, seq_ids, [7] * len(seq_ids))))
                last_sent = time.monotonic()


def _drain(sock: zmq.Socket, n: int, bound_s: float) -> None:
    codec: Codec = Codec(ClientResponse)
    finished, deadline = 0, time.monotonic() + bound_s
    while finished < n:
        if time.monotonic() > deadline or not sock.poll(60_000):
            raise TimeoutError(f"{n - finished} requests unfinished")
        msg = codec.decode(sock.recv())
        if isinstance(msg, RequestError):
            raise RuntimeError(msg.message)
        if isinstance(msg, EngineCoreOutputs):
            finished += sum(o.finished for o in msg.outputs)


def _start_scheduler(port: int, worker_port: int, http_port: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "scheduler", "--port", str(port), "--worker-port", str(worker_port),
         "--http-port", str(http_port), "--log-level", "WARNING"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )


def _wait_ready(http_port: int, bound_s: float) -> None:
    """Until the scheduler's /health is 200 (its worker is ready)."""
    deadline = time.monotonic() + bound_s
    while True:
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=2).status == 200:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError("the scheduler never became ready")
        time.sleep(0.1)


def _run_burst(ctx: zmq.Context, port: int, socks: list[zmq.Socket]) -> float:
    """The decodes, then the burst sent at once while they run; waits for both to
    finish and returns the seconds the burst took. Its sockets join ``socks``."""
    codec: Codec = Codec(ClientRequest)
    decodes, burst = (ctx.socket(zmq.DEALER) for _ in range(2))
    socks += [decodes, burst]
    for s in socks:
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"tcp://127.0.0.1:{port}")
    for i in range(NUM_DECODES):
        decodes.send(codec.encode(Generate(f"d{i}", [3 + i] * 16, max_tokens=DECODE_TOKENS, ignore_eos=True)))
    frames = [
        codec.encode(Generate(f"b{i}", [2 + i % 500, 2 + i // 500] + [2 + (i * 7 + j) % 510 for j in range(BURST_LEN - 2)],
                              max_tokens=2, ignore_eos=True))
        for i in range(NUM_BURST)
    ]
    time.sleep(0.5)  # the decodes are running
    t0 = time.perf_counter()
    for f in frames:
        burst.send(f)
    _drain(burst, NUM_BURST, 600)
    burst_s = time.perf_counter() - t0
    _drain(decodes, NUM_DECODES, 600)
    return burst_s


def _stop(sched: subprocess.Popen, worker: _CountingWorker | None, socks: list[zmq.Socket], ctx: zmq.Context) -> None:
    if worker is not None:
        worker.stop.set()
        worker.join(timeout=10)
        worker.sock.close(linger=0)
    for s in socks:
        s.close(linger=0)
    sched.terminate()
    try:
        sched.wait(timeout=30)
    except subprocess.TimeoutExpired:
        sched.kill()
        sched.wait(timeout=10)
    ctx.term()


def rows() -> list[Row]:
    port, worker_port, http_port = _free_port(), _free_port(), _free_port()
    sched = _start_scheduler(port, worker_port, http_port)
    ctx = zmq.Context()
    worker = None
    socks: list[zmq.Socket] = []
    try:
        worker = _CountingWorker(ctx, f"tcp://127.0.0.1:{worker_port}")
        worker.start()
        _wait_ready(http_port, 60)
        burst_s = _run_burst(ctx, port, socks)
    finally:
        _stop(sched, worker, socks, ctx)
    name = f"burst {NUM_BURST} x {BURST_LEN}-token prompts + {NUM_DECODES} decodes"
    return [
        Row(f"{name}: scheduler's longest silence to its worker", worker.max_gap_s * 1e3, "ms",
            f"< {GAP_TARGET_S * 1e3:.0f} ms", worker.max_gap_s < GAP_TARGET_S and worker.readies == 1),
        Row(f"{name}: burst admitted and served", NUM_BURST / burst_s, "r/s"),
    ]


if __name__ == "__main__":
    from bench.table import print_table

    print_table(rows())
