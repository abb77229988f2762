"""Scheduler benchmarks: one step of the policy in-process, and one big admission.

* A decode step with N running requests of 1,000-token context: schedule, encode
  the plan (``Codec(SchedulerToWorker).encode``), apply a result. The result is
  built directly (every row samples a fixed token), not by a fake worker, so the
  figure is the scheduler's alone. Every 16th step each request needs a new block
  (block size 16): the average runs over whole 16-step cycles; the "unchanged" figure
  is the median of the steps in which no request got a block (the common case).
* Admitting 64 new 1,000-token requests sharing a 512-token prefix that an earlier
  request left in the cache: schedule + encode that one step (requests are built,
  and their prompts hashed, on arrival: outside the step, as in the process).

``python -m bench scheduler`` prints the table.
"""

from __future__ import annotations

import gc
import statistics
import time

from bench.table import Row
from protocol.codec import Codec
from protocol.worker_messages import SchedulerToWorker, StepResult
from scheduler.core.block_pool import BlockPool
from scheduler.core.block_residency import residency_pool_factory
from scheduler.core.hashing import BlockHasher
from scheduler.core.kv_cache_manager import KVCacheManager, PoolFactory
from scheduler.sched.request import Request
from scheduler.sched.scheduler import Scheduler

BS = 16
CONTEXT = 1000
MAX_MODEL_LEN = 1 << 16
SAMPLED = 7
DECODE_TARGET_US = 200.0
PLAN_TARGET_B = 64
ADMIT_TARGET_MS = 3.0


def _prompt(i: int, n: int) -> list[int]:
    return [2 + (i * 131 + j * 17) % 500 for j in range(n)]


def _decode_setup(num_running: int, num_steps: int, pool_factory: PoolFactory = BlockPool) -> tuple[Scheduler, Codec]:
    """``num_running`` requests admitted and prefilled; every one decodes next."""
    blocks_per_request = -(-(CONTEXT + num_steps + 64) // BS)
    num_blocks = num_running * blocks_per_request + 16  # no preemption
    kv = KVCacheManager(num_blocks, BS, MAX_MODEL_LEN, pool_factory=pool_factory)
    sched = Scheduler(kv, num_running, num_running * CONTEXT, MAX_MODEL_LEN)
    hasher = BlockHasher(BS)
    for i in range(num_running):
        sched.add_request(Request(f"r{i}", _prompt(i, CONTEXT), MAX_MODEL_LEN // 2, seq_id=i, ignore_eos=True, block_hasher=hasher))
    out = sched.schedule()
    assert len(out.plan.new_rows) == num_running
    ids = [r.seq_id for r in out.scheduled]
    sched.update_from_output(StepResult(out.plan.step_id, ids, [SAMPLED] * len(ids)))
    return sched, Codec(SchedulerToWorker)


def decode_steps(num_running: int, cycles: int = 40, repeat: int = 2, pool_factory: PoolFactory = BlockPool) -> dict[str, float]:
    """Microseconds per step over one whole 16-step cycle (best of ``cycles`` x
    ``repeat``: on a shared 2-core machine the best cycle is the least disturbed),
    the best median of a cycle's unchanged steps, and plan sizes."""
    num_steps = cycles * BS
    best_avg = best_unchanged = float("inf")
    unchanged_bytes: set[int] = set()
    total_bytes = 0
    for _ in range(repeat):
        sched, codec = _decode_setup(num_running, num_steps, pool_factory)
        encode, schedule, update = codec.encode, sched.schedule, sched.update_from_output
        seq_ids = [r.seq_id for r in sched.running]
        sampled = [SAMPLED] * num_running
        gc.collect()
        for _ in range(cycles):
            per_step: list[tuple[float, bool, int]] = []
            t_cycle = time.perf_counter()
            for _ in range(BS):
                t0 = time.perf_counter()
                out = schedule()
                frame = encode(out.plan)
                update(StepResult(out.plan.step_id, seq_ids, sampled))
                per_step.append((time.perf_counter() - t0, bool(out.plan.appended), len(frame)))
            best_avg = min(best_avg, (time.perf_counter() - t_cycle) / BS)
            best_unchanged = min(best_unchanged, statistics.median(dt for dt, changed, _ in per_step if not changed))
            unchanged_bytes.update(n for _, changed, n in per_step if not changed)
            total_bytes += sum(n for _, _, n in per_step)
        assert sched.num_running == num_running and sched.num_preemptions == 0
    return {
        "avg_us": best_avg * 1e6,
        "unchanged_us": best_unchanged * 1e6,
        "unchanged_bytes": max(unchanged_bytes),
        "avg_bytes": total_bytes / (num_steps * repeat),
    }


def admission_ms(num_new: int = 64, prefix_len: int = 512, repeat: int = 7) -> tuple[float, int]:
    """Best-of-``repeat`` milliseconds for the step admitting ``num_new`` requests
    whose first ``prefix_len`` tokens an earlier (finished) request left cached."""
    best = float("inf")
    nbytes = 0
    prefix = _prompt(999, prefix_len)
    for _ in range(repeat):
        num_blocks = (num_new + 1) * (-(-CONTEXT // BS)) + 16
        kv = KVCacheManager(num_blocks, BS, MAX_MODEL_LEN)
        sched = Scheduler(kv, num_new + 1, (num_new + 1) * CONTEXT, MAX_MODEL_LEN)
        codec = Codec(SchedulerToWorker)
        hasher = BlockHasher(BS)
        first = Request("warm", prefix + _prompt(1000, CONTEXT - prefix_len), 1, seq_id=0, block_hasher=hasher)
        sched.add_request(first)
        out = sched.schedule()
        sched.update_from_output(StepResult(out.plan.step_id, [0], [SAMPLED]))
        assert not sched.has_unfinished_requests()  # its blocks are free, still cached
        for i in range(1, num_new + 1):
            sched.add_request(Request(f"r{i}", prefix + _prompt(i, CONTEXT - prefix_len), 16, seq_id=i, block_hasher=hasher))
        gc.collect()
        t0 = time.perf_counter()
        out = sched.schedule()
        frame = codec.encode(out.plan)
        dt = time.perf_counter() - t0
        assert len(out.plan.new_rows) == num_new
        assert all(row.num_computed_tokens == prefix_len for row in out.plan.new_rows)
        best = min(best, dt)
        nbytes = len(frame)
    return best * 1e3, nbytes


def rows() -> list[Row]:
    out: list[Row] = []
    for n in (1, 64, 256):
        d = decode_steps(n)
        label = f"sched decode step, {n} running x {CONTEXT} ctx"
        if n == 256:
            out.append(Row(f"{label} (avg)", d["avg_us"], "us", f"≤ {DECODE_TARGET_US:g} us", d["avg_us"] <= DECODE_TARGET_US))
        else:
            out.append(Row(f"{label} (avg)", d["avg_us"], "us"))
        out.append(Row(f"{label} (unchanged step)", d["unchanged_us"], "us"))
        out.append(Row(f"plan bytes, {n} running, unchanged batch", d["unchanged_bytes"], "B",
                       f"≤ {PLAN_TARGET_B} B", d["unchanged_bytes"] <= PLAN_TARGET_B))
        out.append(Row(f"plan bytes, {n} running, avg incl. new blocks", d["avg_bytes"], "B"))
    # --kv-cache-metrics, every block watched: the step's cost with the residency hooks.
    d = decode_steps(256, pool_factory=residency_pool_factory())
    out.append(Row(f"sched decode step, 256 running x {CONTEXT} ctx, --kv-cache-metrics (avg)", d["avg_us"], "us",
                   f"≤ {DECODE_TARGET_US:g} us", d["avg_us"] <= DECODE_TARGET_US))
    ms, nbytes = admission_ms()
    out.append(Row("sched admit 64 x 1000 tok, 512 cached (step)", ms, "ms", f"≤ {ADMIT_TARGET_MS:g} ms", ms <= ADMIT_TARGET_MS))
    out.append(Row("plan bytes, admit 64 x 1000 tok", nbytes / 1024, "KiB"))
    return out


if __name__ == "__main__":
    from bench.table import print_table

    print_table(rows())
