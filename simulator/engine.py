"""The offline simulator's loop: the real Scheduler, KVCacheManager and BlockPool,
no worker, virtual time.

Each step: requests whose arrival time has come are queued (or rejected, by the
server's own checks: scheduler/sched/validation.py);
`Scheduler.schedule()` plans a step; the step takes
``step_overhead + per_token * num_scheduled_tokens`` of virtual time; then a
stand-in worker samples one token, unique to its request, for every row that
completed its tokens, and `Scheduler.update_from_output` applies it. With nothing
to run the clock jumps to the next arrival. Time is integer nanoseconds, so a run is
exactly reproducible and fast-forwarding changes nothing.

Pure decode stretches are fast-forwarded (simulator/fastforward.py).

With a host tier (``num_host_blocks``, the scheduler's own HostTier) a plan carries
the tier's copies: its loads add ``bytes / offload_bandwidth_gbps`` to the step
(they run before its tokens); its stores add nothing (the worker overlaps them).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from protocol.client_messages import Generate
from protocol.worker_messages import StepResult
from scheduler.core.hashing import BlockHasher
from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.core.offload_tier import HostTier
from scheduler.sched.request import Request
from scheduler.sched.scheduler import Scheduler
from scheduler.sched.validation import RequestLimits, RequestRejected, validate_generate
from simulator.fastforward import decode_horizon, fast_forward_decode
from simulator.free_policies import pool_class
from simulator.workload import OUTPUT_TOKEN_BASE, Workload

NOT_YET = -1


@dataclass(frozen=True, slots=True)
class SimConfig:
    num_blocks: int
    block_size: int = 16
    policy: str = "vllm"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 131072
    step_overhead_ms: float = 5.0
    ms_per_token: float = 0.02
    hash_algo: str = "xxhash"
    fast_forward: bool = True
    # The host tier (scheduler/core/offload_tier.py): slots, when blocks go there
    # ("eviction" or write-through "full"), the bandwidth a load is charged at, and
    # the KV bytes of one token over all layers (bytes moved; the default is a
    # Llama-3-8B in bfloat16: 2 x 32 layers x 8 KV heads x 128 dims x 2 bytes).
    num_host_blocks: int = 0
    offload_store: str = "eviction"
    offload_bandwidth_gbps: float = 25.0
    kv_bytes_per_token: int = 131072
    # vLLM 0.32's scheduler_reserve_full_isl (scheduler/sched/scheduler.py).
    reserve_full_sequence: bool = True


@dataclass(slots=True)
class SimResult:
    """One run's figures (what the table and --result-json show), plus per-request
    times in virtual ns (NOT_YET where it never happened) for tests."""

    num_blocks: int
    policy: str
    # First admissions only, as vllm:prefix_cache_queries/_hits count them.
    prefix_cache_hit_rate: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    # Re-admissions of preempted requests (they hit their own freed blocks), apart.
    prefix_cache_preempted_hit_rate: float
    prefix_cache_preempted_queries: int
    prefix_cache_preempted_hits: int
    num_evictions: int
    num_preemptions: int
    num_rejected: int
    num_requests: int
    num_finished: int
    peak_usage: float
    mean_queueing_delay_ms: float
    p99_queueing_delay_ms: float
    mean_ttft_ms: float
    simulated_s: float
    num_steps: int
    num_fast_forwarded_steps: int
    wall_s: float
    # The host tier (zeros without one). host_hit_rate: host hits over all looked-up
    # tokens, so prefix_cache_hit_rate + host_hit_rate = combined_hit_rate;
    # external_prefix_cache_hit_rate is vLLM's: host hits over the tokens the device
    # did not hold (vllm:external_prefix_cache_hits / _queries).
    num_host_blocks: int = 0
    host_hit_rate: float = 0.0
    combined_hit_rate: float = 0.0
    external_prefix_cache_hit_rate: float = 0.0
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    num_host_stores: int = 0
    num_host_loads: int = 0
    num_host_stores_skipped: int = 0
    num_host_evictions: int = 0
    bytes_stored: int = 0
    bytes_loaded: int = 0
    load_time_s: float = 0.0
    admit_ns: list[int] = field(default_factory=list, repr=False)
    first_token_ns: list[int] = field(default_factory=list, repr=False)
    finish_ns: list[int] = field(default_factory=list, repr=False)

    def summary(self) -> dict:
        """The JSON row: every figure, no per-request lists."""
        return {k: getattr(self, k) for k in self.__slots__ if not k.endswith("_ns")}


def _percentile(values: list[int], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])


def simulate(workload: Workload, cfg: SimConfig, on_end: Callable[[Scheduler], None] | None = None) -> SimResult:
    """Replay ``workload`` through a fresh scheduler and pool; see the module doc.
    ``on_end`` (tests) sees the scheduler once the run is over."""
    wall_start = time.perf_counter()
    workload.reset()
    bs = cfg.block_size
    tier = HostTier(cfg.num_host_blocks, bs) if cfg.num_host_blocks else None
    kv = KVCacheManager(cfg.num_blocks, bs, cfg.max_model_len, pool_factory=pool_class(cfg.policy), host_tier=tier,
                        offload_store=cfg.offload_store)  # fmt: skip
    fast_forward = cfg.fast_forward
    block_bytes = cfg.kv_bytes_per_token * bs
    num_loads = 0
    sched = Scheduler(kv, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len, cfg.reserve_full_sequence)
    hasher = BlockHasher(bs, cfg.hash_algo)
    pool = kv.block_pool
    overhead_ns = round(cfg.step_overhead_ms * 1e6)
    per_token_ns = round(cfg.ms_per_token * 1e6)
    specs = workload.specs
    n = len(specs)
    token_base = workload.output_token_base
    admit_ns = [NOT_YET] * n
    first_token_ns = [NOT_YET] * n
    finish_ns = [NOT_YET] * n
    order = sorted(range(n), key=lambda i: specs[i].arrival_ns)
    next_arrival = 0
    num_rejected = num_steps = num_ff_steps = 0
    usable = cfg.num_blocks - 1
    now = 0

    # NOTE: prompt token ids lie below the output ones (simulator/workload.py).
    limits = RequestLimits(OUTPUT_TOKEN_BASE, cfg.max_model_len, bs, num_usable_blocks=usable)

    def arrive(i: int) -> None:
        nonlocal num_rejected
        s = specs[i]
        prompt, hashes = workload.prompt(i, hasher)
        try:
            validate_generate(Generate(str(i), prompt, s.output_len, ignore_eos=True), limits, ())
        except RequestRejected:
            num_rejected += 1
            return
        req = Request(
            str(i), prompt, s.output_len, seq_id=i, ignore_eos=True, block_hasher=hasher,
            arrival_time=s.arrival_ns / 1e9, block_hashes=hashes,
        )  # fmt: skip
        sched.add_request(req)

    while True:
        while next_arrival < n and specs[order[next_arrival]].arrival_ns <= now:
            arrive(order[next_arrival])
            next_arrival += 1
        host_evictions = tier.num_evictions if tier is not None else 0
        out = sched.schedule()
        if out is None:
            if next_arrival == n:
                if sched.has_unfinished_requests():
                    raise RuntimeError("simulation stuck: requests left but nothing can be scheduled")
                break
            now = specs[order[next_arrival]].arrival_ns
            continue
        num_steps += 1
        plan = out.plan
        for row in plan.new_rows:
            admit_ns[row.seq_id] = now
        step_ns = overhead_ns + per_token_ns * out.num_scheduled_tokens
        if plan.tier_copies is not None and plan.tier_copies.load_device_ids:
            # Loads run before the step's tokens: charged by bandwidth (1 GB/s = 1 byte/ns).
            # Stores are not: the worker overlaps them (a side stream on CUDA).
            loads = len(plan.tier_copies.load_device_ids)
            num_loads += loads
            step_ns += round(loads * block_bytes / cfg.offload_bandwidth_gbps)
        now += step_ns
        seq_ids, token_ids = [], []
        for req in out.scheduled:
            if req.num_computed_tokens == req.num_tokens:
                seq_ids.append(req.seq_id)
                token_ids.append(token_base[req.seq_id] + req.num_output_tokens)
        outputs = sched.update_from_output(StepResult(plan.step_id, seq_ids, token_ids))
        for r in outputs.requests:
            if first_token_ns[r.seq_id] == NOT_YET:
                first_token_ns[r.seq_id] = now
        for i in outputs.finish_reasons:
            finish_ns[outputs.requests[i].seq_id] = now
        any_finished = bool(outputs.finish_reasons)
        if not fast_forward or any_finished or plan.new_rows or plan.resumed_rows or out.preempted:
            continue
        running = sched.running
        if out.num_scheduled_tokens != len(running) or len(seq_ids) != len(running):
            continue  # not every running request decoded one token
        if tier is not None and tier.num_evictions != host_evictions:
            # NOTE: the plan's write-through stores evicted from the host tier after the
            # waiting head was tried: it may have lost host hits, and fit next step.
            continue
        if next_arrival < n:
            gap = specs[order[next_arrival]].arrival_ns - now
            if gap <= 0:
                continue
            limit = -(-gap // step_ns)  # steps that start before the next arrival
        else:
            limit = 1 << 62
        k = decode_horizon(sched, limit)
        if k > 0:
            fast_forward_decode(sched, k, token_base)
            num_steps += k
            num_ff_steps += k
            now += k * step_ns

    if on_end is not None:
        on_end(sched)
    stats, ext = kv.prefix_cache_stats, kv.external_prefix_cache_stats
    host_hits = ext.hits if tier is not None else 0
    delays = [admit_ns[i] - specs[i].arrival_ns for i in range(n) if admit_ns[i] != NOT_YET]
    ttfts = [first_token_ns[i] - specs[i].arrival_ns for i in range(n) if first_token_ns[i] != NOT_YET]
    return SimResult(
        num_blocks=cfg.num_blocks,
        policy=cfg.policy,
        prefix_cache_hit_rate=stats.hit_rate,
        prefix_cache_queries=stats.queries,
        prefix_cache_hits=stats.hits,
        prefix_cache_preempted_hit_rate=stats.preempted_hit_rate,
        prefix_cache_preempted_queries=stats.preempted_queries,
        prefix_cache_preempted_hits=stats.preempted_hits,
        num_evictions=pool.num_evictions,
        num_preemptions=sched.num_preemptions,
        num_rejected=num_rejected,
        num_requests=n,
        num_finished=sum(1 for t in finish_ns if t != NOT_YET),
        peak_usage=kv.peak_usage,
        mean_queueing_delay_ms=sum(delays) / len(delays) / 1e6 if delays else 0.0,
        p99_queueing_delay_ms=_percentile(delays, 0.99) / 1e6,
        mean_ttft_ms=sum(ttfts) / len(ttfts) / 1e6 if ttfts else 0.0,
        simulated_s=now / 1e9,
        num_steps=num_steps,
        num_fast_forwarded_steps=num_ff_steps,
        wall_s=time.perf_counter() - wall_start,
        num_host_blocks=cfg.num_host_blocks,
        host_hit_rate=host_hits / stats.queries if stats.queries else 0.0,
        combined_hit_rate=(stats.hits + host_hits) / stats.queries if stats.queries else 0.0,
        external_prefix_cache_hit_rate=ext.hit_rate if tier is not None else 0.0,
        external_prefix_cache_queries=ext.queries if tier is not None else 0,
        external_prefix_cache_hits=host_hits,
        num_host_stores=tier.num_stores if tier is not None else 0,
        num_host_loads=tier.num_loads if tier is not None else 0,
        num_host_stores_skipped=tier.num_stores_skipped if tier is not None else 0,
        num_host_evictions=tier.num_evictions if tier is not None else 0,
        bytes_stored=(tier.num_stores if tier is not None else 0) * block_bytes,
        bytes_loaded=(tier.num_loads if tier is not None else 0) * block_bytes,
        load_time_s=num_loads * block_bytes / cfg.offload_bandwidth_gbps / 1e9,
        admit_ns=admit_ns,
        first_token_ns=first_token_ns,
        finish_ns=finish_ns,
    )
