"""The scheduler's Prometheus metrics: what feeds each family from the scheduler's state.

The pool and the policy keep plain counters; `SchedulerMetrics.update` copies
them into Prometheus objects once per step (never inside the hot loops); the
families are scheduler/engine/metric_families.py's, the per-request and per-step
histograms scheduler/engine/request_metrics.py's.
"""

from __future__ import annotations

from prometheus_client import generate_latest

from scheduler.core.block_residency import ResidencyBlockPool
from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.core.kv_cache_usage import get_peak_usage, get_token_usage
from scheduler.core.offload.external_tier import ExternalTier
from scheduler.engine.metric_families import SchedulerMetricFamilies
from scheduler.engine.request_metrics import observe_many
from scheduler.sched.outputs import StepTokens
from scheduler.sched.scheduler import Scheduler
from scheduler.spec.spec_stats import SpecDecodingStats

# The source an external tier's hits count under (metric_families.CACHE_HIT_SOURCES).
EXTERNAL_SOURCES = {"disk": "disk", "mooncake": "external_unspecified"}


class SchedulerMetrics(SchedulerMetricFamilies):
    """The families, fed: once a step (`update`, the step gauges) and per event."""

    def record_admission_rejection(self, reason: str) -> None:
        """A request refused by a queue limit (``reason``: one of ADMISSION_REASONS)."""
        self.admission_rejections[reason].inc()

    def observe_perf(self, flops: int, read_bytes: int, write_bytes: int) -> None:
        """One executed step's estimates (scheduler/engine/perf_metrics.py)."""
        self.estimated_flops.inc(flops)
        self.estimated_read_bytes.inc(read_bytes)
        self.estimated_write_bytes.inc(write_bytes)

    def _sync_spec_decode(self, stats: SpecDecodingStats) -> None:
        # NOTE: a metrics object built without the --speculative-config (its families then
        # absent until now) still exports a speculating scheduler's counters, from its first update.
        if self.spec_decode is None:
            self._add_spec_decode(stats.num_spec_tokens)
        m = self.spec_decode
        self._sync("spec_drafts", m["drafts"], stats.num_drafts)
        self._sync("spec_draft_tokens", m["draft_tokens"], stats.num_draft_tokens)
        self._sync("spec_accepted", m["accepted"], stats.num_accepted_tokens)
        per_pos = zip(m["per_pos"], stats.num_accepted_tokens_per_pos, strict=True)
        for pos, (child, value) in enumerate(per_pos):
            self._sync(f"spec_pos{pos}", child, value)

    # NOTE: the gauges vLLM takes from each step's SchedulerStats (KV usage, running,
    # waiting) are set once a step, as vLLM's, not from the live state at every scrape:
    # a scrape lands while a step runs, when the pool still holds the blocks of the
    # requests that step finishes, and the waiting queue holds requests that arrived
    # since the schedule (vLLM's engine takes them in only before its next schedule);
    # read live, the peak usage stood above vLLM's and requests the next schedule
    # admitted read as waiting.

    def update_waiting_gauges(self, scheduler: Scheduler) -> None:
        """Waiting requests, right after a schedule: those it left waiting, what vLLM
        reports at the end of the step (later arrivals count from the next schedule)."""
        self.num_waiting.set(scheduler.num_waiting)
        deferred = len(scheduler.waiting_for_grammar)
        self.num_waiting_by_reason["capacity"].set(scheduler.num_waiting - deferred)
        self.num_waiting_by_reason["deferred"].set(deferred)

    def update_step_gauges(self, scheduler: Scheduler, kv: KVCacheManager) -> None:
        """KV usage and running requests once a step's result is applied (its finished
        requests freed), before the next schedule: vLLM's reading."""
        self.kv_cache_usage.set(kv.block_pool.get_usage())
        self.num_running.set(scheduler.num_running)

    def update(self, scheduler: Scheduler, kv: KVCacheManager) -> None:
        """Every other family from the live state (counters, pool gauges); any time."""
        pool = kv.block_pool
        self.free_blocks.set(pool.get_num_free_blocks())
        self.free_cached_blocks.set(pool.num_free_cached_blocks)
        self.num_gpu_blocks.set(pool.num_gpu_blocks)
        self.cached_hashes.set(len(pool.cached_block_hash_to_block))
        stats = kv.prefix_cache_stats
        self._sync("queries", self.prefix_cache_queries, stats.queries)
        self._sync("hits", self.prefix_cache_hits, stats.hits)
        self._sync("preempted_queries", self.prefix_cache_preempted_queries, stats.preempted_queries)
        self._sync("preempted_hits", self.prefix_cache_preempted_hits, stats.preempted_hits)
        self._sync("preemptions", self.num_preemptions, scheduler.num_preemptions)
        self._sync("worker_loss", self.worker_loss_recomputes, scheduler.num_worker_loss_recomputes)
        prompt = scheduler.prompt_token_stats
        self._sync("prompt", self.prompt_tokens, prompt.total)
        self._sync("prompt_cached", self.prompt_tokens_cached, prompt.cached_tokens)
        by_source = self.prompt_tokens_by_source
        self._sync("src_compute", by_source["local_compute"], prompt.computed)
        self._sync("src_local", by_source["local_cache_hit"], prompt.local_cache_hit)
        self._sync("src_external", by_source["external_kv_transfer"], prompt.external_kv_transfer)
        self._sync("generation", self.generation_tokens, scheduler.num_generation_tokens)
        if scheduler.spec_stats is not None:
            self._sync_spec_decode(scheduler.spec_stats)
        self._sync("evictions", self.evictions, pool.num_evictions)
        pinned = kv.pinned
        self.pinned_blocks.set(pinned.num_pinned_blocks)
        self._sync("pin_refusals", self.pin_refusals, pinned.num_refusals)
        self._sync("pins_cleared", self.pins_cleared, pinned.num_cleared)
        self._sync("pins_expired", self.pins_expired, pinned.num_expired)
        ext = kv.external_prefix_cache_stats
        self._sync("ext_queries", self.external_prefix_cache_queries, ext.queries)
        self._sync("ext_hits", self.external_prefix_cache_hits, ext.hits)
        self._sync("cached_device", self.prompt_tokens_cached_by_source["device"], stats.hits)
        outside, pd = kv.external, scheduler.kv_transfer
        num_outside = 0 if outside is None else outside.num_loads * kv.block_size
        num_p2p = 0 if pd is None else pd.num_pull_tokens
        self._sync("cached_host", self.prompt_tokens_cached_by_source["host"], ext.hits - num_outside - num_p2p)
        if num_p2p:
            self._sync("cached_p2p", self.prompt_tokens_cached_by_source["p2p"], num_p2p)
        if outside is not None:
            self._sync("cached_outside", self.prompt_tokens_cached_by_source[EXTERNAL_SOURCES[outside.backend]], num_outside)
            self._update_external(outside)
        tier, m = kv.host_tier, self.offload
        if tier is not None and m is not None:
            m["usage"].set(tier.get_usage())
            m["cached"].set(tier.num_cached_blocks)
            m["num_blocks"].set(tier.num_host_blocks)
            self._sync("offload_stores", m["stores"], tier.num_stores)
            self._sync("offload_loads", m["loads"], tier.num_loads)
            self._sync("offload_skipped", m["skipped"], tier.num_stores_skipped)
            self._sync("offload_dropped", m["dropped"], tier.num_stores_dropped)
            self._sync("offload_evictions", m["evictions"], tier.num_evictions)
        self.peak_kv_cache_usage.set(get_peak_usage(kv))
        if self._token_usage_of is None or self._token_usage_of[0] is not scheduler or self._token_usage_of[1] is not kv:
            self._token_usage_of = (scheduler, kv)
            self.kv_cache_token_usage.set_function(lambda: get_token_usage(kv, scheduler.running))
        if self.kv_block_lifetime is not None and isinstance(pool, ResidencyBlockPool):
            samples = pool.take_residency()
            observe_many(self.kv_block_lifetime, samples.lifetimes)
            observe_many(self.kv_block_idle_before_evict, samples.idle_before_evict)
            observe_many(self.kv_block_reuse_gap, samples.reuse_gaps)

    def _update_external(self, tier: ExternalTier) -> None:
        """The external tier's counters, as the scheduler sees them (the worker's /metrics has its bytes and times)."""
        m = self.external
        if m is None:
            m = self.external = self._external_metrics()
        self._sync("ext_saves", m["saves"], tier.num_saves)
        self._sync("ext_skipped", m["skipped"], tier.num_saves_skipped)
        self._sync("ext_loads", m["loads"], tier.num_loads)
        self._sync("ext_failed", m["failed"], tier.num_load_failures)
        self._sync("ext_removed", m["removed"], tier.num_removed)
        self._sync("ext_unreachable", m["unreachable"], getattr(tier.index, "num_unreachable", 0))

    def observe_step(self, outputs: StepTokens, plan_bytes: int, step_s: float) -> None:
        """One executed step: its plan's size, its wall time, the latencies and requests it completed."""
        self.steps.inc()
        self.plan_bytes.inc(plan_bytes)
        self.step_duration.observe(step_s)
        self.request_metrics.observe_step(outputs)

    def render(self) -> bytes:
        return generate_latest(self.registry)
