"""`simulate`: one workload replayed through a fresh engine (simulator/engine.py), and
the run's figures (`run_result`, a `SimResult`). With ``external_warm`` the workload is
replayed once first to fill the external store, and the run measured is a second replay
with everything else fresh (a restart)."""

from __future__ import annotations

import time
from collections.abc import Callable

from scheduler.core.kv_cache_usage import get_peak_usage
from scheduler.sched.scheduler import Scheduler
from simulator.config import SimConfig
from simulator.engine import EngineRun
from simulator.external_store import SimulatedStore
from simulator.result import NOT_YET, SimResult
from simulator.spec_decode import spec_figures
from simulator.token_times import percentile
from simulator.workload import Workload


def simulate(workload: Workload, cfg: SimConfig, on_end: Callable[[Scheduler], None] | None = None) -> SimResult:
    """Replay ``workload`` through a fresh scheduler and pool; see the module doc.
    ``on_end`` (tests) sees the scheduler once the run is over."""
    wall_start = time.perf_counter()
    workload.reset()
    store = None if cfg.external_tier == "none" else SimulatedStore(cfg.external_tier_blocks)
    if store is not None and cfg.external_warm:
        EngineRun(workload, cfg, store=store).run()  # NOTE: its queued saves are in the store already (a drained shutdown)
        workload.reset()
    run = EngineRun(workload, cfg, store=store)
    run.run()
    if on_end is not None:
        on_end(run.sched)
    return run_result(run, wall_start)


def run_result(run: EngineRun, wall_start: float) -> SimResult:
    """The run's figures, ``wall_s`` counted from ``wall_start``."""
    kv, tier, specs, n, external = run.kv, run.tier, run.specs, run.n, run.external
    stats, ext = kv.prefix_cache_stats, kv.external_prefix_cache_stats
    # NOTE: the manager counts the host tier's hits and the external tier's together (as vLLM's connector stats).
    external_hits = external.num_hit_tokens if external is not None else 0
    if tier is not None:
        host_hits, stores, loads, skipped = ext.hits - external_hits, tier.num_stores, tier.num_loads, tier.num_stores_skipped
    else:
        host_hits = stores = loads = skipped = 0
    delays = [run.admit_ns[i] - specs[i].arrival_ns for i in range(n) if run.admit_ns[i] != NOT_YET]
    ttfts = [run.first_token_ns[i] - specs[i].arrival_ns for i in range(n) if run.first_token_ns[i] != NOT_YET]
    block_bytes, gbps = run.block_bytes, run.cfg.offload_bandwidth_gbps
    return SimResult(
        num_blocks=run.cfg.num_blocks,
        policy=run.cfg.policy,
        eviction_policy=run.cfg.eviction_policy,
        num_pinned_blocks=kv.pinned.num_pinned_blocks,
        prefix_cache_hit_rate=stats.hit_rate,
        prefix_cache_queries=stats.queries,
        prefix_cache_hits=stats.hits,
        prefix_cache_preempted_hit_rate=stats.preempted_hit_rate,
        prefix_cache_preempted_queries=stats.preempted_queries,
        prefix_cache_preempted_hits=stats.preempted_hits,
        num_evictions=kv.block_pool.num_evictions,
        num_preemptions=run.sched.num_preemptions,
        num_rejected=run.num_rejected,
        num_requests=n,
        num_finished=sum(1 for t in run.finish_ns if t != NOT_YET),
        peak_usage=get_peak_usage(kv),
        mean_queueing_delay_ms=sum(delays) / len(delays) / 1e6 if delays else 0.0,
        p99_queueing_delay_ms=percentile(delays, 0.99) / 1e6,
        mean_ttft_ms=sum(ttfts) / len(ttfts) / 1e6 if ttfts else 0.0,
        simulated_s=run.now / 1e9,
        num_steps=run.num_steps,
        num_fast_forwarded_steps=run.num_ff_steps,
        wall_s=time.perf_counter() - wall_start,
        num_host_blocks=run.cfg.num_host_blocks,
        host_hit_rate=host_hits / stats.queries if stats.queries else 0.0,
        combined_hit_rate=(stats.hits + host_hits + external_hits) / stats.queries if stats.queries else 0.0,
        external_prefix_cache_hit_rate=ext.hit_rate if tier is not None or external is not None else 0.0,
        external_prefix_cache_queries=ext.queries if tier is not None or external is not None else 0,
        external_prefix_cache_hits=host_hits + external_hits,
        num_host_stores=stores,
        num_host_loads=loads,
        num_host_stores_skipped=skipped,
        num_host_evictions=tier.num_evictions if tier is not None else 0,
        bytes_stored=stores * block_bytes,
        bytes_loaded=loads * block_bytes,
        load_time_s=run.num_loads * block_bytes / gbps / 1e9,
        **spec_figures(run.spec_k, run.sched.spec_stats),
        **({} if external is None else external.figures(run.now, stats.queries)),
        external_tier_warm=external is not None and run.cfg.external_warm,
        admit_ns=run.admit_ns,
        first_token_ns=run.first_token_ns,
        finish_ns=run.finish_ns,
    )
