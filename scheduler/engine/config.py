"""The scheduler process's one frozen config, built from the command line
(``scheduler.engine.args.config_from_args``).

Flags use vLLM's names where vLLM has one; a setting ``kvpool serve`` gives the
scheduler takes its default from the settings table's row (protocol/serve_flags/).
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.serve_flags.cache import (
    BLOCK_SIZE,
    ENABLE_PREFIX_CACHING,
    KV_CACHE_DTYPE,
    KV_OFFLOADING_BACKEND,
    KV_OFFLOADING_SIZE,
    PREFIX_CACHING_HASH_ALGO,
)
from protocol.serve_flags.engine import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    ENABLE_LOGGING_ITERATION_DETAILS,
    ENABLE_MFU_METRICS,
    KV_CACHE_METRICS,
    KV_CACHE_METRICS_SAMPLE,
    LOG_LEVEL,
    MAX_NUM_SEQS,
    SCHEDULER_RESERVE_FULL_ISL,
)
from protocol.serve_flags.kvpool import (
    DEV_MODE,
    KV_EVENTS_TOPIC,
    KV_EVICTION_POLICY,
    MAX_PINNED_FRACTION,
)
from protocol.serve_flags.model import DEFAULT_MAX_MODEL_LEN, DEFAULT_SERVED_MODEL_NAME, DTYPE
from protocol.serve_flags.scheduling import (
    ENABLE_CHUNKED_PREFILL,
    LONG_PREFILL_TOKEN_THRESHOLD,
    LONG_PREFILL_TOKEN_THRESHOLD_ADAPTIVE,
    SCHEDULING_POLICY,
    WATERMARK,
)
from scheduler.engine.model_shape import ModelShape


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    host: str = "127.0.0.1"
    port: int = 5555
    worker_port: int = 5556
    http_port: int = 8000
    block_size: int = BLOCK_SIZE.default
    # The worker's --kv-cache-dtype: the scheduler counts blocks, not bytes; it reports
    # the name (vllm:cache_config_info) and estimates KV traffic with it (--enable-mfu-metrics).
    kv_cache_dtype: str = KV_CACHE_DTYPE.default
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = ENABLE_PREFIX_CACHING.default
    max_num_seqs: int = MAX_NUM_SEQS.default
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    # vLLM 0.32's scheduling-policy options (scheduler/sched/policy_options.py).
    scheduling_policy: str = SCHEDULING_POLICY.default
    long_prefill_token_threshold: int = LONG_PREFILL_TOKEN_THRESHOLD.default
    long_prefill_token_threshold_adaptive: bool = LONG_PREFILL_TOKEN_THRESHOLD_ADAPTIVE.default
    enable_chunked_prefill: bool = ENABLE_CHUNKED_PREFILL.default
    watermark: float = WATERMARK.default
    max_num_scheduled_tokens: int | None = None  # None: --max-num-batched-tokens
    max_num_active_seqs: int | None = None  # None: --max-num-seqs
    # vLLM 0.32's scheduler_reserve_full_isl: admit a waiting request only if its whole
    # sequence fits the free blocks, not just its first chunk (scheduler/sched/scheduler.py).
    scheduler_reserve_full_isl: bool = SCHEDULER_RESERVE_FULL_ISL.default
    # Requests queued beyond the running ones; more are refused with a RequestError.
    # NOTE: a waiting request holds its prompt once, as a Python list: this limit is
    # what keeps the scheduler's memory finite under a flood of requests.
    max_num_waiting: int = 100_000
    # kvpool's own packed-token hash (the default) or one of vLLM's, exactly (scheduler/core/vllm_hashing.py).
    prefix_caching_hash_algo: str = PREFIX_CACHING_HASH_ALGO.default
    # PYTHONHASHSEED as the scheduler started, the seed of vLLM's NONE_HASH (None: unset).
    python_hash_seed: str | None = None
    dev_mode: bool = DEV_MODE.default
    log_level: str = LOG_LEVEL.default
    # The periodic stats line (scheduler/engine/stats_logger.py): off with --disable-log-stats; its period is VLLM_LOG_STATS_INTERVAL.
    log_stats: bool = True
    log_stats_interval_s: float = 10.0
    enable_logging_iteration_details: bool = ENABLE_LOGGING_ITERATION_DETAILS.default  # one more line per step (stats_logger.py)
    custom_histogram_buckets: dict | None = None  # family -> bounds (scheduler/engine/metric_buckets.py)
    model_name: str = DEFAULT_SERVED_MODEL_NAME
    # A worker silent for this long (no heartbeat, no result) is taken for dead. NOTE: the same as the
    # worker's --scheduler-timeout; both sides heartbeat every 0.5 s when idle (docs/operations.md, "Liveness").
    worker_timeout_s: float = 10.0
    # With no worker for this long, waiting requests end with a RequestError.
    worker_reconnect_timeout_s: float = 30.0
    # Largest client frame answered; ZeroMQ drops connections sending 4x this.
    max_frame_bytes: int = 1 << 20
    # CURVE: the scheduler's secret certificate and the folder of peers' public ones.
    curve_secret_key: str | None = None
    curve_authorized_keys: str | None = None
    # KV events in vLLM's wire format (for KV-aware routers); off without an endpoint.
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = KV_EVENTS_TOPIC.default
    kv_events_buffer_steps: int = 10_000
    # "bind" always (kvpool's flag), or "vllm": bind a wildcard/ipc/inproc endpoint, else connect.
    kv_events_endpoint_mode: str = "bind"
    kv_events_hwm: int = 100_000
    # vLLM's KVEventsConfig.max_queue_size, reported in /engine_info. NOTE: it bounds nothing
    # here: the step loop publishes each batch itself, without vLLM's queue.
    kv_events_max_queue_size: int = 100_000
    # Hashes as 64-bit ints (vLLM 0.33's default) or the full bytes.
    kv_events_int_block_hashes: bool = True
    # This engine's rank among replicas, in every KV event batch (vLLM's data_parallel_rank).
    data_parallel_rank: int = 0
    # vLLM's KV residency histograms; kvpool watches every block by default (vLLM: 0.01).
    kv_cache_metrics: bool = KV_CACHE_METRICS.default
    kv_cache_metrics_sample: float = KV_CACHE_METRICS_SAMPLE.default
    # The host-memory offload tier (vLLM's --kv-offloading-size, GiB): on when > 0.
    # The worker allocates it; the tier gets the slots its WorkerHello offers.
    kv_offloading_size: float = KV_OFFLOADING_SIZE.default
    # When blocks are copied to the host tier: "eviction" (their hash leaves the device) or "full" (write-through, once computed).
    kv_offloading_store: str = "eviction"
    # The external tier below it (scheduler/core/offload/external_tier.py): "native" none; "disk" (the
    # worker's directory; the worker lists it at hello) or "mooncake" (a shared store: its
    # master is asked which blocks it holds; the metadata server is the store's).
    kv_offloading_backend: str = KV_OFFLOADING_BACKEND.default
    mooncake_master: str | None = None
    mooncake_metadata: str | None = None
    # P/D disaggregation (vLLM's --kv-transfer-config JSON, protocol/kv_transfer_config.py); None: off.
    kv_transfer_config: str | None = None
    # The device pool's eviction policy (scheduler/core/retention/eviction_policies.py); lru: the free queue's own order.
    kv_eviction_policy: str = KV_EVICTION_POLICY.default
    # Pinned blocks (POST /v1/cache/pin) may hold at most this share of the pool's blocks.
    max_pinned_fraction: float = MAX_PINNED_FRACTION.default
    # vLLM's --enable-mfu-metrics (vllm:estimated_*_per_gpu): estimated from the
    # checkpoint's config.json (--model) in the worker's --dtype (scheduler/engine/perf_metrics.py).
    enable_mfu_metrics: bool = ENABLE_MFU_METRICS.default
    model: str | None = None
    # The checkpoint's shape, read by the flag check (scheduler/engine/model_shape.py); None without MFU metrics.
    model_shape: ModelShape | None = None
    dtype: str = DTYPE.default
    # vLLM's --speculative-config JSON (protocol/speculative_config.py); None: no speculation.
    speculative_config: str | None = None

    @property
    def curve(self) -> bool:
        return self.curve_secret_key is not None

    @property
    def client_address(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    @property
    def worker_address(self) -> str:
        return f"tcp://{self.host}:{self.worker_port}"
