"""Two (or N) real tensor-parallel ranks in child processes, driven like the worker
drives them: rank 0 runs the MiniScheduler's plans through its runner and fans each
plan out (``worker.parallel.plan_fanout``) to the other ranks, which run ``RankFollower``.

``run_group(jobs, world_size)`` returns, per job, rank 0's sampled tokens and logits
per request, and each rank's KV cache, for the test to compare with a one-rank run.
Every child is joined within a bound (killed past it), also on failure. ``rank_pids``
finds the ranks a ``python -m worker --tensor-parallel-size N`` started.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import random
from dataclasses import dataclass

import torch

from kvtest.ports import free_port
from kvtest.procs import children
from protocol.codec import Codec
from protocol.worker_messages import SchedulerToWorker, WorkerReady

NUM_BLOCKS = 128
BLOCK_SIZE = 8
MAX_NUM_SEQS = 16
MAX_MODEL_LEN = 128


@dataclass(frozen=True)
class Job:
    checkpoint: str
    dtype: str  # "float32" | "float64"
    seed: int


def drive(runner, seed: int, vocab: int):
    """The MiniScheduler workload every run of a job gets (the same plans, block ids too)."""
    from kvtest.mini_scheduler import MiniScheduler

    rng = random.Random(seed)
    sched = MiniScheduler(runner, rng, NUM_BLOCKS, BLOCK_SIZE)
    for sid in range(5):
        sched.add(sid, [rng.randrange(2, vocab) for _ in range(rng.randint(1, 30))], rng.randint(2, 8))
    for _ in range(2):
        sched.step()
    donors = [sid for sid, r in sched.live.items() if r.computed >= BLOCK_SIZE]
    for sid in range(5, 8):
        prompt = [rng.randrange(2, vocab) for _ in range(rng.randint(BLOCK_SIZE + 1, 30))]
        sched.add(sid, prompt, rng.randint(2, 8), share_from=donors[0] if donors and sid % 2 else None)
    sched.run()
    assert not sched.live and not sched.preempted
    return sched


def outputs(sched) -> dict[int, tuple[list[int], list[tuple[int, torch.Tensor]]]]:
    return {sid: (list(r.out), [(pos, lg.clone()) for pos, lg in r.logits]) for sid, r in sched.done.items()}


# NOTE: tensors cross the queue as numpy arrays (pickled by value): torch's own sharing
# hands out file descriptors the exiting child would take with it.
def _pack(outs, caches):
    packed = None if outs is None else {sid: (o, [(p, lg.numpy()) for p, lg in lgs]) for sid, (o, lgs) in outs.items()}
    return packed, [kv.numpy() for kv in caches]


def _unpack(outs, caches):
    unpacked = None if outs is None else {sid: (o, [(p, torch.from_numpy(lg)) for p, lg in lgs]) for sid, (o, lgs) in outs.items()}
    return unpacked, [torch.from_numpy(kv) for kv in caches]


class FanningRunner:
    """Rank 0's runner as the MiniScheduler sees it: every plan goes to the group first."""

    def __init__(self, runner, fanout, codec):
        self.runner, self.fanout, self.codec = runner, fanout, codec
        self.last_tokens: list[int] = []

    def execute(self, plan):
        from worker.parallel.plan_fanout import Kind

        self.fanout.send(Kind.PLAN, self.last_tokens, self.codec.encode(plan))
        out = self.runner.execute(plan)
        self.last_tokens = out.sampled_token_ids
        return out


def _rank_main(rank: int, world_size: int, port: int, jobs: list[Job], results: mp.Queue) -> None:
    from worker.kv.kv_cache import allocate_kv_caches
    from worker.load.serving_model import load_serving_model
    from worker.models.config import DTYPES
    from worker.parallel.distributed import TPGroup
    from worker.parallel.plan_fanout import Kind, PlanFanout
    from worker.parallel.rank_follower import RankFollower
    from worker.step.runner import ModelRunner

    torch.set_num_threads(1)
    group = TPGroup(rank, world_size, f"tcp://127.0.0.1:{port}", torch.device("cpu"), 60, 60)
    try:
        started = False
        for i, job in enumerate(jobs):
            serving = load_serving_model(job.checkpoint, job.dtype, "cpu", MAX_MODEL_LEN, group, BLOCK_SIZE)
            if not started:
                group.start()
                started = True
            m, c = serving.model, serving.config
            caches = allocate_kv_caches(c.num_layers, NUM_BLOCKS, BLOCK_SIZE, m.num_kv_heads, c.head_dim, DTYPES[job.dtype], "cpu")
            fanout = PlanFanout(group)
            if rank == 0:
                codec: Codec = Codec(SchedulerToWorker)
                ready = WorkerReady(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_seqs=MAX_NUM_SEQS,
                                    max_model_len=MAX_MODEL_LEN, next_step_id=0)
                fanout.send(Kind.READY, (), codec.encode(ready))
                runner = ModelRunner(m, caches, MAX_NUM_SEQS, MAX_MODEL_LEN)
                sched = drive(FanningRunner(runner, fanout, codec), job.seed, c.vocab_size)
                fanout.send(Kind.STOP)
                covered = {"bytes_sent": fanout.bytes_sent, "chunked": sched.num_chunked, "shared": sched.num_shared,
                           "preempted": sched.num_preempted}
                results.put((i, rank, *_pack(outputs(sched), caches), covered))
            else:
                follower = RankFollower(m, caches, fanout)
                assert follower.run() == 0
                results.put((i, rank, *_pack(None, caches), follower.num_steps))
    finally:
        group.close()


def run_group(jobs: list[Job], world_size: int = 2, timeout: float = 240.0) -> dict[int, dict[int, tuple]]:
    """{job index: {rank: (outputs or None, kv caches, rank 0: what the plans covered and
    the bytes it fanned out / other ranks: the steps they ran)}}."""
    port = free_port()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, port, jobs, results), daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, dict[int, tuple]] = {}
    try:
        import time

        deadline = time.monotonic() + timeout
        while sum(len(v) for v in out.values()) < len(jobs) * world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the ranks did not finish {len(jobs)} jobs within {timeout} s")
            try:
                i, rank, outs, caches, extra = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a rank exited with status {dead[0]}") from None
                continue
            out.setdefault(i, {})[rank] = (*_unpack(outs, caches), extra)
        return out
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)


def rank_pids(parent: int) -> dict[int, int]:
    """rank -> pid of the ranks ``parent`` started (``--rank N`` on their command line)."""
    out = {}
    for pid, cmd in children(parent).items():
        argv = cmd.split()
        if "--rank" in argv:
            out[int(argv[argv.index("--rank") + 1])] = pid
    return out
