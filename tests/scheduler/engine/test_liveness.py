"""Liveness under a burst: 2,000 prompts of 2,000 tokens sent at once while decodes run.

Each prompt is hashed on arrival (125 SHA-256 blocks), seconds of work in all. The
receive loops must yield to the step loop and heartbeats while they drain it: the
worker must never be declared lost, the scheduler must never go quiet for as long
as a worker waits for it (the loop used to starve, and a real worker exited 3), and
every request must complete.

The worker is a thread in this process that only counts tokens (a contract-checking
fake would be the slow part here); the scheduler is a real process.
"""

from __future__ import annotations

import signal
import threading
import time

import pytest
import zmq
from kvtest.scheduler_harness import BS, EOS, VOCAB, Client, SchedulerProcess

from protocol.client_messages import Generate, RequestError, TokenOutput
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

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]

NUM_BURST, BURST_LEN = 2000, 2000
NUM_DECODES, DECODE_TOKENS = 8, 1500
# The scheduler's --worker-timeout here; the scheduler must never be quiet this long
# either (a real worker waits --scheduler-timeout, the same by default).
TIMEOUT_S = 2.0


class CountingWorker:
    """A worker thread that tracks each row's token counts and samples token 7."""

    def __init__(self, ctx: zmq.Context, address: str, num_blocks: int):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.num_blocks = num_blocks
        self.readies = 0
        self.errors: list[str] = []
        self.max_gap_s = 0.0  # longest silence of the scheduler once ready
        self.num_heartbeats = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.sock.close(linger=0)

    def _run(self) -> None:
        out, inp = Codec(WorkerToScheduler), Codec(SchedulerToWorker)
        rows: dict[int, list[int]] = {}  # seq_id -> [num_tokens, num_computed]
        hello = WorkerHello(0, 1, self.num_blocks, BS, VOCAB, EOS)
        self.sock.send(out.encode(hello))
        last_heard = last_sent = None
        while not self._stop.is_set():
            now = time.monotonic()
            if last_sent is not None and now - last_sent > 0.3:
                self.sock.send(out.encode(Heartbeat(time.time())))
                last_sent = now
            if not self.sock.poll(50):
                continue
            msg = inp.decode(self.sock.recv())
            now = time.monotonic()
            if last_heard is not None:
                self.max_gap_s = max(self.max_gap_s, now - last_heard)
            match msg:
                case WorkerReady():
                    self.readies += 1
                    rows.clear()
                    self.sock.send(out.encode(Heartbeat(time.time())))
                    last_heard = last_sent = time.monotonic()
                case StepPlan():
                    last_heard = now
                    for sid in (*msg.finished_seq_ids, *msg.preempted_seq_ids):
                        rows.pop(sid, None)
                    for row in (*msg.new_rows, *msg.resumed_rows):
                        rows[row.seq_id] = [len(row.token_ids), row.num_computed_tokens]
                    seq_ids, sampled = [], []
                    for sid, r in rows.items():
                        n = msg.num_scheduled_tokens.get(sid, 1)
                        if n == 0:
                            continue
                        r[1] += n
                        if r[1] > r[0]:
                            self.errors.append(f"step {msg.step_id}: row {sid} computes past its tokens")
                        if r[1] == r[0]:
                            r[0] += 1
                            seq_ids.append(sid)
                            sampled.append(7)
                    self.sock.send(out.encode(StepResult(msg.step_id, seq_ids, sampled)))
                    last_sent = time.monotonic()
                case Heartbeat():
                    last_heard = now
                    self.num_heartbeats += 1


def _collect(client: Client, ids: set[str], bound_s: float) -> dict[str, list[TokenOutput]]:
    got: dict[str, list[TokenOutput]] = {i: [] for i in ids}
    pending = set(ids)
    deadline = time.monotonic() + bound_s
    while pending:
        assert time.monotonic() < deadline, f"{len(pending)} requests unfinished after {bound_s} s"
        msg = client.recv(timeout_s=60)
        assert not isinstance(msg, RequestError), msg
        got[msg.request_id].append(msg)
        if msg.finished:
            pending.discard(msg.request_id)
    return got


def test_a_burst_of_long_prompts_starves_neither_the_worker_nor_the_decodes():
    ctx = zmq.Context()
    sched = SchedulerProcess("--worker-timeout", str(TIMEOUT_S), "--max-model-len", "4096")
    worker = decodes = burst = None
    try:
        sched.wait_http()
        worker = CountingWorker(ctx, sched.worker_address, num_blocks=4096)
        sched.wait_health(200, bound_s=15)
        decodes, burst = Client(ctx, sched.client_address), Client(ctx, sched.client_address)
        for i in range(NUM_DECODES):
            decodes.send(Generate(f"d{i}", [3 + i] * 16, max_tokens=DECODE_TOKENS, ignore_eos=True))
        first = decodes.recv(timeout_s=30)
        assert isinstance(first, TokenOutput)
        # Distinct prompts (no prefix hits): each is hashed whole on arrival. Encoded
        # first, then sent at once, so that they queue up at the scheduler.
        frames = []
        for i in range(NUM_BURST):
            prompt = [2 + (i * 7 + j) % (VOCAB - 2) for j in range(BURST_LEN)]
            prompt[0] = 2 + i % (VOCAB - 2)
            prompt[1] = 2 + i // (VOCAB - 2)
            frames.append(burst.out.encode(Generate(f"b{i}", prompt, max_tokens=2, ignore_eos=True)))
        for frame in frames:
            burst.send_raw(frame)
        got = _collect(burst, {f"b{i}" for i in range(NUM_BURST)}, bound_s=400)
        assert all(o[-1].finish_reason == "length" and sum(len(x.new_token_ids) for x in o) == 2 for o in got.values())
        dec = _collect(decodes, {f"d{i}" for i in range(NUM_DECODES)}, bound_s=200)
        dec[first.request_id].insert(0, first)
        assert all(sum(len(x.new_token_ids) for x in o) == DECODE_TOKENS for o in dec.values())

        assert worker.errors == []
        assert worker.readies == 1, "the worker was dropped and handshook again"
        print(f"longest silence of the scheduler: {worker.max_gap_s:.3f} s")
        assert worker.max_gap_s < TIMEOUT_S, f"the scheduler was silent for {worker.max_gap_s:.2f} s"
        sched.proc.send_signal(signal.SIGTERM)
        assert sched.proc.wait(timeout=30) == 0
        log = sched.proc.stdout.read().decode(errors="replace")
        assert "lost" not in log, log
    finally:
        for c in (decodes, burst):
            if c is not None:
                c.close()
        if worker is not None:
            worker.close()
        sched.stop()
        ctx.term()
