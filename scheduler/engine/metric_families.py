"""The scheduler's Prometheus families, with vLLM's names, labels, buckets and help text.

`SchedulerMetricFamilies` registers them (in /metrics' order) and holds the primitive
that feeds a counter from a plain one (`_sync`); `SchedulerMetrics`
(scheduler/engine/metrics.py) feeds each from the scheduler's state.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from protocol.speculative_config import SpeculativeConfig
from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.engine.metric_buckets import histogram_buckets
from scheduler.engine.request_metrics import RequestMetrics
from scheduler.sched.scheduler import Scheduler

# vLLM's sources of prompt tokens (vllm:prompt_tokens_by_source), and of cache hits
# (vllm:prompt_tokens_cached_by_source, vLLM's CacheHitSource): here the device's
# prefix cache and the host tier.
PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
CACHE_HIT_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")
# vLLM's reasons of vllm:admission_rejections and vllm:num_requests_waiting_by_reason.
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")
WAITING_REASONS = ("capacity", "deferred")
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class SchedulerMetricFamilies:
    def __init__(self, model_name: str, engine: str = "0", kv_cache_metrics: bool = False, kv_offloading: bool = False,
                 max_model_len: int = 4096, custom_buckets: dict | None = None,
                 speculative: SpeculativeConfig | None = None):
        """``kv_cache_metrics``: also the KV residency histograms (vLLM's
        --kv-cache-metrics; the pool must be a `ResidencyBlockPool`).
        ``kv_offloading``: also the host tier's (--kv-offloading-size).
        ``max_model_len``: the top of the token-count buckets (vLLM's); ``custom_buckets``:
        --custom-histogram-buckets (scheduler/engine/metric_buckets.py).
        ``speculative``: --speculative-config; the ``vllm:spec_decode_*`` counters exist only
        with it, as vLLM's SpecDecodingProm."""
        self._custom_buckets = custom_buckets
        self.registry = CollectorRegistry()
        self._labels = ["model_name", "engine"]
        self._label_values = (model_name, engine)
        # NOTE: /metrics lists the families in the order they are registered here.
        self._add_kv_cache_usage()
        self._add_prefix_cache()
        self._add_requests()
        self.request_metrics = RequestMetrics(self._histogram, max_model_len, custom_buckets)
        self._add_pool()
        self._add_steps()
        # NOTE: before the perf counters, as vLLM registers SpecDecodingProm before PerfMetricsProm.
        self.spec_decode: dict | None = None
        if speculative is not None:
            self._add_spec_decode(speculative.num_speculative_tokens)
        self._add_perf()
        self.kv_block_lifetime = self.kv_block_idle_before_evict = self.kv_block_reuse_gap = None
        if kv_cache_metrics:
            self._add_residency()
        self.offload = self._offload_metrics() if kv_offloading else None
        self._last: dict[str, int] = {}
        # The external tier's counters, made with its first update (None: no tier).
        self.external: dict | None = None
        self._token_usage_of: tuple[Scheduler, KVCacheManager] | None = None

    def _gauge(self, name: str, doc: str):
        return Gauge(name, doc, self._labels, registry=self.registry).labels(*self._label_values)

    def _counter(self, name: str, doc: str):
        return Counter(name, doc, self._labels, registry=self.registry).labels(*self._label_values)

    def _histogram(self, name: str, doc: str, buckets):
        return Histogram(name, doc, self._labels, buckets=buckets, registry=self.registry).labels(*self._label_values)

    def _add_kv_cache_usage(self) -> None:
        gauge = self._gauge
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.peak_kv_cache_usage = gauge(
            "kvpool_peak_kv_cache_usage_perc", "Highest vllm:kv_cache_usage_perc since start, taken at every allocation."
        )
        # NOTE: read at scrape time (set_function): it walks the running requests.
        self.kv_cache_token_usage = gauge(
            "kvpool_kv_cache_token_usage_perc",
            "KV-cache usage in tokens: token slots of held blocks that hold a token, over all token slots.",
        )

    def _add_prefix_cache(self) -> None:
        counter = self._counter
        self.prefix_cache_queries = counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        # vLLM keeps these in PrefixCacheStats.preempted_* without exporting them.
        self.prefix_cache_preempted_queries = counter(
            "kvpool_prefix_cache_preempted_queries", "Prefix cache queries of requests resumed after preemption, in tokens."
        )
        self.prefix_cache_preempted_hits = counter(
            "kvpool_prefix_cache_preempted_hits", "Prefix cache hits of requests resumed after preemption, in tokens."
        )
        # vLLM's KV connector counters: here the host tier is the connector.
        self.external_prefix_cache_queries = counter(
            "vllm:external_prefix_cache_queries", "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of queried tokens."
        )
        self.external_prefix_cache_hits = counter(
            "vllm:external_prefix_cache_hits", "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of cached tokens."
        )
        # Counted at each request's first token, as vllm:prompt_tokens (scheduler/sched/prompt_token_stats.py).
        self.prompt_tokens_by_source = self._by_label(Counter, "vllm:prompt_tokens_by_source", "Number of prompt tokens by source.",
                                                      "source", PROMPT_TOKEN_SOURCES)
        self.prompt_tokens_cached = counter("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).")
        # NOTE: no multi-modal inputs here: 0, as vLLM's for a text-only model.
        counter("vllm:mm_cache_queries", "Multi-modal cache queries, in terms of number of queried items.")
        counter("vllm:mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items.")
        # Counted at admission, as vllm:prefix_cache_hits and vllm:external_prefix_cache_hits.
        self.prompt_tokens_cached_by_source = self._by_label(
            Counter, "vllm:prompt_tokens_cached_by_source", "Prefix-cache hit tokens by the cache tier that supplied them: "
            "device (local HBM), host (offloaded to DRAM), disk, p2p (transferred from another vLLM instance) or "
            "external_unspecified. Counted at admission; sums to vllm:prefix_cache_hits + vllm:external_prefix_cache_hits.",
            "source", CACHE_HIT_SOURCES,
        )

    def _by_label(self, kind, name: str, doc: str, label: str, values: tuple[str, ...]) -> dict:
        """A family with one more label, a child per value (all exported from the start)."""
        family = kind(name, doc, [*self._labels, label], registry=self.registry)
        return {v: family.labels(*self._label_values, v) for v in values}

    def _add_requests(self) -> None:
        gauge, counter = self._gauge, self._counter
        self.num_running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.num_waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        # NOTE: the one deferral here is a grammar still compiling (vLLM's blocked status
        # WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR); vLLM's others (LoRA budget, KV transfer) do not exist.
        self.num_waiting_by_reason = self._by_label(
            Gauge, "vllm:num_requests_waiting_by_reason", "Number of waiting requests by reason. Reason labels: 'capacity' = "
            "waiting for scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, "
            "blocked status). Sum of all reasons equals vllm:num_requests_waiting.", "reason", WAITING_REASONS,
        )
        # NOTE: kvpool has no sleep mode: always awake, as vLLM's before any /sleep.
        sleep = self._by_label(Gauge, "vllm:engine_sleep_state", "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 "
                               "means engine is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep "
                               "level 2.", "sleep_state", ("awake", "weights_offloaded", "discard_all"))
        sleep["awake"].set(1)
        self.num_preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.worker_loss_recomputes = counter(
            "kvpool_worker_loss_recomputes", "Running requests sent back to waiting, to be recomputed, because the worker was lost "
            "(not preemptions: not in vllm:num_preemptions nor vllm:request_num_preemptions).",
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        # vLLM's frontend counts these; here the scheduler refuses (--max-num-waiting). No engine label, as vLLM.
        rejections = Counter("vllm:admission_rejections", "Number of admission attempts rejected by a queue limit, by reason.",
                             ["model_name", "reason"], registry=self.registry)
        self.admission_rejections = {r: rejections.labels(self._label_values[0], r) for r in ADMISSION_REASONS}
        self.cache_config_info: Gauge | None = None

    def set_cache_config_info(self, info: dict[str, str]) -> None:
        """vllm:cache_config_info, once the pool exists (scheduler/engine/cache_config_info.py)."""
        if self.cache_config_info is None:
            labels = {**info, "engine": self._label_values[1]}
            self.cache_config_info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                           list(labels), registry=self.registry)
            self.cache_config_info.labels(**labels).set(1)

    def _add_pool(self) -> None:
        gauge = self._gauge
        self.free_cached_blocks = gauge("kvpool_free_cached_blocks", "Free blocks that still hold a prefix-cache hash.")
        self.free_blocks = gauge("kvpool_free_blocks", "Free blocks (cached or not).")
        self.num_gpu_blocks = gauge("kvpool_num_gpu_blocks", "Blocks in the pool, the null block included.")
        self.kv_block_bytes = gauge("kvpool_kv_block_bytes", "Bytes of one KV block on a worker rank (K and V of its every KV tensor), as its hello reports.")
        self.cached_hashes = gauge("kvpool_cached_block_hashes", "Distinct block hashes in the prefix cache (held or free).")
        self.evictions = self._counter("kvpool_evictions", "Cached blocks that lost their hash to a new owner (lazy eviction).")
        self.pinned_blocks = gauge("kvpool_pinned_blocks", "Blocks held by pins (POST /v1/cache/pin): never evicted while pinned.")
        self.pin_refusals = self._counter("kvpool_pin_refusals", "Pin requests refused: the pinned blocks would exceed --max-pinned-fraction.")
        self.pins_cleared = self._counter("kvpool_pins_cleared", "Pinned blocks released by a prefix-cache reset or a lost worker.")
        self.pins_expired = self._counter("kvpool_pins_expired", "Pinned blocks released when their ttl_s ran out.")

    def _add_steps(self) -> None:
        self.steps = self._counter("kvpool_steps", "Steps executed.")
        self.plan_bytes = self._counter("kvpool_plan_bytes", "Bytes of step plans sent to workers.")
        self.step_duration = self._histogram(
            "kvpool_step_duration_seconds", "Wall time of one step: schedule, worker round trip, update.", STEP_BUCKETS
        )

    def _add_spec_decode(self, num_spec_tokens: int) -> None:
        """vLLM's SpecDecodingProm: three counters, and the accepted tokens of each draft
        position 0..k-1 (a child per position, exported from the start)."""
        counter = self._counter
        self.spec_decode = dict(
            drafts=counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts."),
            draft_tokens=counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens."),
            accepted=counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."),
            per_pos=list(self._by_label(Counter, "vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
                                        "position", tuple(str(i) for i in range(num_spec_tokens))).values()),
        )

    def _add_perf(self) -> None:
        # NOTE: vLLM's PerfMetricsProm families, always exported; they count only under
        # --enable-mfu-metrics (`observe_perf`), and stay 0 without it, as vLLM's.
        counter = self._counter
        self.estimated_flops = counter("vllm:estimated_flops_per_gpu_total", "Estimated number of floating point operations "
                                       "per GPU (for Model Flops Utilization calculations).")
        self.estimated_read_bytes = counter("vllm:estimated_read_bytes_per_gpu_total", "Estimated number of bytes read from "
                                            "memory per GPU (for Model Flops Utilization calculations).")
        self.estimated_write_bytes = counter("vllm:estimated_write_bytes_per_gpu_total", "Estimated number of bytes written to "
                                             "memory per GPU (for Model Flops Utilization calculations).")

    def _add_residency(self) -> None:
        histogram, residency = self._histogram, histogram_buckets("kv_cache_residency", self._custom_buckets)
        self.kv_block_lifetime = histogram(
            "vllm:kv_block_lifetime_seconds", "Histogram of KV cache block lifetime from allocation to eviction. "
            "Sampled metrics (controlled by --kv-cache-metrics-sample).", residency,
        )
        self.kv_block_idle_before_evict = histogram(
            "vllm:kv_block_idle_before_evict_seconds", "Histogram of idle time before KV cache block eviction. "
            "Sampled metrics (controlled by --kv-cache-metrics-sample).", residency,
        )
        self.kv_block_reuse_gap = histogram(
            "vllm:kv_block_reuse_gap_seconds", "Histogram of time gaps between consecutive KV cache block accesses. "
            "Only the most recent accesses are recorded (ring buffer). "
            "Sampled metrics (controlled by --kv-cache-metrics-sample).", residency,
        )

    def _offload_metrics(self) -> dict:
        gauge, counter = self._gauge, self._counter
        # Blocks, not bytes: the scheduler does not know the KV dtype; the worker
        # exports the bytes and times (vllm:kv_offload_total_bytes, ...).
        return dict(
            usage=gauge("vllm:kv_offload_cpu_cache_usage_perc",
                        "Fraction of the CPU offload tier pinned by transfers in flight (vLLM's meaning: 0 when idle)."),
            cached=gauge("kvpool_kv_offload_cpu_cached_blocks", "Host-tier slots holding a block hash (stored or being stored)."),
            num_blocks=gauge("kvpool_kv_offload_num_cpu_blocks", "Slots of the host tier (WorkerReady num_host_blocks)."),
            stores=counter("kvpool_kv_offload_stored_blocks", "Blocks copied from the device to the host tier."),
            loads=counter("kvpool_kv_offload_loaded_blocks", "Blocks copied from the host tier to the device (host-tier hits)."),
            skipped=counter("kvpool_kv_offload_stores_skipped", "Stores not made: the host tier held the block's hash already."),
            dropped=counter("kvpool_kv_offload_stores_dropped", "Stores not made: every host slot was pinned by a transfer in flight."),
            evictions=counter("kvpool_kv_offload_evictions", "Host-tier blocks evicted (LRU) to make room for a store."),
        )

    def _external_metrics(self) -> dict:
        """The external tier's counters, made with its first update (the worker's /metrics has its bytes and times)."""
        return dict(
            saves=self._counter("kvpool_kv_offload_external_saved_blocks", "Blocks the plans asked the worker to save to the external tier."),
            skipped=self._counter("kvpool_kv_offload_external_saves_skipped", "Saves not asked: the external tier held the block already."),
            loads=self._counter("kvpool_kv_offload_external_loaded_blocks", "Blocks admissions claimed from the external tier, loaded off the step path."),
            failed=self._counter("kvpool_kv_offload_external_load_failed_blocks", "Blocks of those loads the worker could not use (computed again)."),
            removed=self._counter("kvpool_kv_offload_external_removed_blocks", "Blocks the worker reported gone from the external tier."),
            unreachable=self._counter("kvpool_kv_offload_external_unreachable",
                                      "Lookups of a shared store whose master did not answer (the tier counted as empty, nothing saved)."),
        )

    def _sync(self, key: str, counter, value: int) -> None:
        delta = value - self._last.get(key, 0)
        if delta > 0:
            counter.inc(delta)
        self._last[key] = value
