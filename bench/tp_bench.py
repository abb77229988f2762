"""Tensor parallelism's per-step cost (``python -m bench tp``): decode steps of the tiny
checkpoint on one rank against two gloo ranks on this CPU, and what the group adds.

* A decode step of B rows (B = 1 and 32; 32-token prompts, prefilled first) on one rank
  (the runner in this process) and on two ranks (two spawned processes, rank 0 fanning
  each plan out as ``kvpool serve`` does, then running it); the figure is rank 0's wall
  time per step, fan-out included, best of several rounds; the ratio TP=2 / TP=1.
* The plan fan-out alone: one gloo broadcast of the 4 KiB message buffer (a decode
  plan's whole message), against the alternative DESIGN.md names, the scheduler sending
  the frame to each rank: one more ZeroMQ message to another process over loopback
  (half a round trip).
* One gloo all-reduce of a decode step's (32, hidden) activations; a step has two per layer.

NOTE: on the 2-core development machine the two ranks share the cores one rank had
(one torch thread each), and every collective waits for the other process to be
scheduled; the ratio there is the group's overhead, not a speed-up. Tensor parallelism
pays where each rank has a device (or cores) of its own and the model's matmuls
dominate; the tiny checkpoint's do not.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import time

import torch

from bench.table import Row

BLOCK_SIZE, PROMPT, STEPS, ROUNDS = 16, 32, 24, 5
BATCHES = (1, 32)


def _plans(batch: int, vocab: int):
    from protocol.worker_messages import RequestRow, StepPlan

    per_row = -(-(PROMPT + STEPS * ROUNDS + 8) // BLOCK_SIZE)
    rows = [RequestRow(i, [(7 * i + j) % (vocab - 2) + 2 for j in range(PROMPT)], list(range(1 + i * per_row, 1 + (i + 1) * per_row)))
            for i in range(batch)]
    prefill = StepPlan(0, {i: PROMPT for i in range(batch)}, rows)
    return prefill, [StepPlan(1 + k) for k in range(STEPS * ROUNDS)], 1 + batch * per_row


def _runner(serving, num_blocks: int, batch: int):
    from worker.kv.kv_cache import allocate_kv_caches
    from worker.models.config import DTYPES
    from worker.step.runner import ModelRunner

    m, c = serving.model, serving.config
    caches = allocate_kv_caches(c.num_layers, num_blocks, BLOCK_SIZE, m.num_kv_heads, c.head_dim, DTYPES[serving.dtype], "cpu")
    return caches, ModelRunner(m, caches, max(batch, 1), 1024)


def _best_step_us(execute, decodes) -> float:
    best = float("inf")
    for r in range(ROUNDS):
        chunk = decodes[r * STEPS : (r + 1) * STEPS]
        t0 = time.perf_counter()
        for plan in chunk:
            execute(plan)
        best = min(best, (time.perf_counter() - t0) / len(chunk))
    return best * 1e6


def one_rank_step_us(batch: int) -> float:
    from worker.load.serving_model import load_serving_model

    torch.set_num_threads(1)  # as each of the two ranks
    serving = load_serving_model(None, "float32", "cpu", 1024)
    prefill, decodes, num_blocks = _plans(batch, serving.config.vocab_size)
    _, runner = _runner(serving, num_blocks, batch)
    runner.execute(prefill)
    return _best_step_us(runner.execute, decodes)


class _FanningStep:
    """Rank 0's step as the worker takes it: fan the plan (and the last tokens) out, run it."""

    def __init__(self, fanout, runner, codec, kind):
        self.fanout, self.runner, self.codec, self.kind = fanout, runner, codec, kind
        self.last: list[int] = []

    def __call__(self, plan) -> None:
        self.fanout.send(self.kind, self.last, self.codec.encode(plan))
        self.last = self.runner.execute(plan).sampled_token_ids


def _rank_main(rank: int, port: int, out: mp.Queue) -> None:
    from protocol.codec import Codec
    from protocol.worker_messages import SchedulerToWorker, WorkerReady
    from worker.load.serving_model import load_serving_model
    from worker.parallel.distributed import TPGroup
    from worker.parallel.plan_fanout import Kind, PlanFanout
    from worker.parallel.rank_follower import RankFollower

    torch.set_num_threads(1)
    group = TPGroup(rank, 2, f"tcp://127.0.0.1:{port}", torch.device("cpu"), 60, 60)
    try:
        serving = load_serving_model(None, "float32", "cpu", 1024, group, BLOCK_SIZE)
        group.start()
        codec: Codec = Codec(SchedulerToWorker)
        results: dict[str, float] = {}
        for batch in BATCHES:
            prefill, decodes, num_blocks = _plans(batch, serving.config.vocab_size)
            caches, runner = _runner(serving, num_blocks, batch)
            fanout = PlanFanout(group)
            if rank:
                RankFollower(serving.model, caches, fanout).run()
                continue
            fanout.send(Kind.READY, (), codec.encode(WorkerReady(num_blocks, BLOCK_SIZE, max(batch, 1), 1024, 0)))
            execute = _FanningStep(fanout, runner, codec, Kind.PLAN)
            execute(prefill)
            results[f"step{batch}"] = _best_step_us(execute, decodes)
            fanout.send(Kind.STOP)
        # The collectives alone, both ranks taking part.
        fanout = PlanFanout(group)
        x = torch.zeros(32, serving.config.hidden_size)  # (32, H): a 32-row decode step's activations
        for name, op in (("broadcast", lambda: group.broadcast(fanout.buf)), ("all_reduce", lambda: group.all_reduce(x))):
            best = float("inf")
            for _ in range(ROUNDS):
                t0 = time.perf_counter()
                for _ in range(200):
                    op()
                best = min(best, (time.perf_counter() - t0) / 200)
            results[name] = best * 1e6
        if rank == 0:
            out.put(results)
    finally:
        group.close()


def two_rank_figures(timeout: float = 300.0) -> dict[str, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, port, out), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        return out.get(timeout=timeout)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)


def _echo(port: int) -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{port}")
    sock.send(b"hi")
    while (msg := sock.recv()) != b"stop":
        sock.send(msg)
    sock.close(0)
    ctx.term()


def zmq_one_way_us(frame: bytes, n: int = 500) -> float:
    """Half a loopback ZeroMQ round trip of ``frame`` to another process and back: what
    the scheduler sending each plan to one more rank would put on the step's path."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    proc = None
    try:
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        proc = mp.get_context("spawn").Process(target=_echo, args=(port,), daemon=True)
        proc.start()
        if not sock.poll(60_000):
            raise TimeoutError("the echo process did not connect within 60 s")
        sock.recv()
        best = float("inf")
        for _ in range(ROUNDS):
            t0 = time.perf_counter()
            for _ in range(n):
                sock.send(frame)
                sock.recv()
            best = min(best, (time.perf_counter() - t0) / n)
        sock.send(b"stop")
        return best * 1e6 / 2
    finally:
        if proc is not None:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        sock.close(0)
        ctx.term()


def rows() -> list[Row]:
    from protocol.codec import Codec
    from protocol.worker_messages import SchedulerToWorker, StepPlan

    tp2 = two_rank_figures()
    out = []
    for batch in BATCHES:
        tp1 = one_rank_step_us(batch)
        two = tp2[f"step{batch}"]
        out += [
            Row(f"tp: decode step, {batch} rows, 1 rank", tp1, "µs"),
            Row(f"tp: decode step, {batch} rows, 2 gloo ranks", two, "µs"),
            Row(f"tp: 2 ranks / 1 rank, {batch} rows", two / tp1, "x", "none on 2 cores"),
        ]
    frame = Codec(SchedulerToWorker).encode(StepPlan(123))
    out += [
        Row("tp: plan fan-out, gloo broadcast of 4 KiB", tp2["broadcast"], "µs", "per step"),
        Row(f"tp: alternative, ZMQ to one more process, {len(frame)}-byte plan", zmq_one_way_us(frame), "µs", "per rank per step"),
        Row("tp: gloo all_reduce of (32, 256) float32", tp2["all_reduce"], "µs", "8 per step (2 x 4 layers)"),
    ]
    return out
