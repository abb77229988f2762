"""The scheduler process's one frozen config, built from the command line.

Flags use vLLM's names where vLLM has one.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
from dataclasses import dataclass

from protocol.curve import CurveKeyError, load_keypair
from protocol.kv_cache_spec import DEFAULT_BLOCK_SIZE, KV_CACHE_DTYPES
from protocol.kv_events import INT_BLOCK_HASHES_ENV, int_block_hashes_from_env
from protocol.kv_transfer_config import parse_kv_transfer_config
from protocol.speculative_config import parse_speculative_config
from scheduler.core.kv_cache_manager import OFFLOAD_STORE_MODES
from scheduler.core.retention.eviction_policies import KV_EVICTION_POLICIES
from scheduler.core.vllm_hashing import (
    DEFAULT_PREFIX_CACHING_HASH_ALGO,
    PREFIX_CACHING_HASH_ALGOS,
    RANDOMLY_SEEDED_ALGOS,
)
from scheduler.engine.kv_event_endpoints import (
    ENDPOINT_MODES,
    check_connect_endpoint,
    check_local_endpoint,
    is_bind_endpoint,
)
from scheduler.engine.metric_buckets import custom_histogram_buckets
from scheduler.engine.one_group_flags import add_one_group_args, check_one_group_args
from scheduler.engine.perf_metrics import DTYPE_BYTES, ModelShape
from scheduler.sched.policy_options import add_policy_args, check_scheduler_options

# vLLM's async scheduling plans step N+1 before step N's result is in; kvpool plans a
# step only once the previous result is applied (DESIGN.md rule 3: blocks are cached
# at scheduling time), so --async-scheduling is refused as vLLM refuses it where its
# executor cannot (``does not support async scheduling yet``).
ASYNC_SCHEDULING_REFUSED = (
    "--async-scheduling: kvpool's scheduler does not support async scheduling yet: it plans a step only after the "
    "previous step's result is applied (drop the flag, or pass --no-async-scheduling)"
)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    host: str = "127.0.0.1"
    port: int = 5555
    worker_port: int = 5556
    http_port: int = 8000
    block_size: int = DEFAULT_BLOCK_SIZE
    # The worker's --kv-cache-dtype: the scheduler counts blocks, not bytes; it reports
    # the name (vllm:cache_config_info) and estimates KV traffic with it (--enable-mfu-metrics).
    kv_cache_dtype: str = "auto"
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    # vLLM 0.32's scheduling-policy options (scheduler/sched/policy_options.py).
    scheduling_policy: str = "fcfs"
    long_prefill_token_threshold: int = 0
    long_prefill_token_threshold_adaptive: bool = False
    enable_chunked_prefill: bool = True
    watermark: float = 0.0
    max_num_scheduled_tokens: int | None = None  # None: --max-num-batched-tokens
    max_num_active_seqs: int | None = None  # None: --max-num-seqs
    # vLLM 0.32's scheduler_reserve_full_isl: admit a waiting request only if its whole
    # sequence fits the free blocks, not just its first chunk (scheduler/sched/scheduler.py).
    scheduler_reserve_full_isl: bool = True
    # Requests queued beyond the running ones; more are refused with a RequestError.
    # NOTE: a waiting request holds its prompt once, as a Python list: this limit is
    # what keeps the scheduler's memory finite under a flood of requests.
    max_num_waiting: int = 100_000
    # kvpool's own packed-token hash (the default) or one of vLLM's, exactly (scheduler/core/vllm_hashing.py).
    prefix_caching_hash_algo: str = DEFAULT_PREFIX_CACHING_HASH_ALGO
    # PYTHONHASHSEED as the scheduler started, the seed of vLLM's NONE_HASH (None: unset).
    python_hash_seed: str | None = None
    dev_mode: bool = False
    log_level: str = "INFO"
    # The periodic stats line (scheduler/engine/stats_logger.py): off with --disable-log-stats; its period is VLLM_LOG_STATS_INTERVAL.
    log_stats: bool = True
    log_stats_interval_s: float = 10.0
    enable_logging_iteration_details: bool = False  # one more line per step (stats_logger.py)
    custom_histogram_buckets: dict | None = None  # family -> bounds (scheduler/engine/metric_buckets.py)
    model_name: str = "kvpool-tiny"
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
    kv_events_topic: str = ""
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
    kv_cache_metrics: bool = False
    kv_cache_metrics_sample: float = 1.0
    # The host-memory offload tier (vLLM's --kv-offloading-size, GiB): on when > 0.
    # The worker allocates it; the tier gets the slots its WorkerHello offers.
    kv_offloading_size: float = 0.0
    # When blocks are copied to the host tier: "eviction" (their hash leaves the device) or "full" (write-through, once computed).
    kv_offloading_store: str = "eviction"
    # The external tier below it (scheduler/core/offload/external_tier.py): "native" none; "disk" (the
    # worker's directory; the worker lists it at hello) or "mooncake" (a shared store: its
    # master is asked which blocks it holds; the metadata server is the store's).
    kv_offloading_backend: str = "native"
    mooncake_master: str | None = None
    mooncake_metadata: str | None = None
    # P/D disaggregation (vLLM's --kv-transfer-config JSON, protocol/kv_transfer_config.py); None: off.
    kv_transfer_config: str | None = None
    # The device pool's eviction policy (scheduler/core/retention/eviction_policies.py); lru: the free queue's own order.
    kv_eviction_policy: str = "lru"
    # Pinned blocks (POST /v1/cache/pin) may hold at most this share of the pool's blocks.
    max_pinned_fraction: float = 0.5
    # vLLM's --enable-mfu-metrics (vllm:estimated_*_per_gpu): estimated from the
    # checkpoint's config.json (--model) in the worker's --dtype (scheduler/engine/perf_metrics.py).
    enable_mfu_metrics: bool = False
    model: str | None = None
    dtype: str = "auto"
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


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def build_parser() -> argparse.ArgumentParser:
    d = SchedulerConfig()
    p = argparse.ArgumentParser(prog="kvpool-scheduler", description="kvpool scheduler: owns the BlockPool and schedules steps for the worker.")
    p.add_argument("--host", default=d.host, help="address every socket binds (default %(default)s)")
    p.add_argument("--port", type=int, default=d.port, help="client ROUTER port (default %(default)s)")
    p.add_argument("--worker-port", type=int, default=d.worker_port, help="worker ROUTER port (default %(default)s)")
    p.add_argument("--http-port", type=int, default=d.http_port, help="/metrics, /health (default %(default)s)")
    p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block (default %(default)s)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=d.kv_cache_dtype,
                   help="the worker's --kv-cache-dtype, for vllm:cache_config_info and the MFU estimates (default %(default)s)")
    p.add_argument("--num-gpu-blocks-override", type=int, default=None, metavar="N", help="a pool of N blocks; the worker must hold as many (give it the flag too; kvpool serve does)")
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false", help="turn the prefix cache off")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="most requests running at once (default %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help=f"token budget of one step (default {d.max_num_batched_tokens}; with --no-enable-chunked-prefill, "
                        "at least --max-model-len, as vLLM)")
    p.add_argument("--max-model-len", type=int, default=d.max_model_len, help="most tokens of one request, prompt + output (default %(default)s)")
    p.add_argument("--scheduler-reserve-full-isl", action=argparse.BooleanOptionalAction, default=d.scheduler_reserve_full_isl,
                   help="admit a waiting request only if its whole sequence fits the free blocks, not only its first "
                        "chunk (vLLM's flag and default: on)")
    add_one_group_args(p)
    g = p.add_argument_group("scheduling policy (vLLM's SchedulerConfig)")
    add_policy_args(g)
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="not supported: kvpool plans a step once the previous one's result is in (--no-async-scheduling is accepted)")
    p.add_argument("--max-num-waiting", type=int, default=d.max_num_waiting,
                   help="most requests waiting to run; more are refused (default %(default)s, ~36 bytes a prompt token each)")
    p.add_argument("--prefix-caching-hash-algo", choices=PREFIX_CACHING_HASH_ALGOS, default=d.prefix_caching_hash_algo,
                   help="kvpool_sha256 / kvpool_xxhash: kvpool's own over packed tokens (default %(default)s); sha256, "
                        "sha256_cbor, xxhash, xxhash_cbor: vLLM's, exactly, seeded from PYTHONHASHSEED as vLLM")
    # NOTE: VLLM_SERVER_DEV_MODE as well (vLLM's switch; the frontend reads it too, so
    # one variable given to `kvpool serve` opens /reset_prefix_cache end to end).
    dev_env = os.environ.get("KVPOOL_DEV_MODE") == "1" or os.environ.get("VLLM_SERVER_DEV_MODE", "0").strip() not in ("", "0")
    p.add_argument("--dev-mode", action="store_true", default=dev_env,
                   help="enable development endpoints (POST /reset_prefix_cache); also KVPOOL_DEV_MODE=1 or VLLM_SERVER_DEV_MODE=1")
    p.add_argument("--log-level", default=d.log_level, type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.add_argument("--disable-log-stats", dest="log_stats", action="store_false",
                   help="no periodic stats line (throughput, running/waiting, KV usage, hit rate) every "
                        "VLLM_LOG_STATS_INTERVAL seconds (default: logged, every 10 s)")
    p.add_argument("--enable-logging-iteration-details", action=argparse.BooleanOptionalAction, default=False, help="with the stats on, log each step's requests and tokens, as vLLM")
    p.add_argument("--custom-histogram-buckets", type=custom_histogram_buckets, metavar="JSON", help="vLLM's histogram bounds by family, as JSON")
    p.add_argument("--served-model-name", dest="model_name", default=d.model_name, help="the model_name label of every metric")
    p.add_argument("--worker-timeout", dest="worker_timeout_s", type=float, default=d.worker_timeout_s, metavar="SECONDS",
                   help="a worker silent this long is taken for dead (default %(default)s)")
    p.add_argument("--worker-reconnect-timeout", dest="worker_reconnect_timeout_s", type=float, default=d.worker_reconnect_timeout_s,
                   metavar="SECONDS", help="with no worker this long, waiting requests fail (default %(default)s)")
    p.add_argument("--max-frame-bytes", type=int, default=d.max_frame_bytes,
                   help="largest client frame answered (default %(default)s); a peer sending 4x this is disconnected")
    g = p.add_argument_group("security (ZeroMQ CURVE; required to bind a non-loopback --host)")
    g.add_argument("--curve-secret-key", metavar="FILE", help="the scheduler's secret certificate (NAME.key_secret, see `python -m protocol.curve`)")
    g.add_argument("--curve-authorized-keys", metavar="DIR", help="folder of the public certificates of allowed workers and clients")
    p.add_argument("--kv-cache-metrics", action="store_true",
                   help="KV residency histograms (vllm:kv_block_lifetime_seconds, _idle_before_evict_, _reuse_gap_)")
    p.add_argument("--kv-cache-metrics-sample", type=float, default=d.kv_cache_metrics_sample, metavar="FRACTION",
                   help="fraction of block allocations watched, in (0, 1] (default %(default)s: every block; vLLM's is 0.01)")
    _add_mfu_flags(p, d)
    _add_tier_flags(p, d)
    _add_retention_and_event_flags(p, d)
    return p


def _add_tier_flags(p: argparse.ArgumentParser, d: SchedulerConfig) -> None:
    """The tiers below the device pool, and P/D disaggregation's connector."""
    g = p.add_argument_group("offload tier (vLLM's native CPU offloading)")
    g.add_argument("--kv-offloading-size", type=float, default=d.kv_offloading_size, metavar="GIB",
                   help="keep evicted KV blocks in host memory and load them back on a hit; the worker allocates the "
                        "GiB (give it the same flag) and the tier takes the slots it offers (default %(default)s: off)")
    g.add_argument("--kv-offloading-store", choices=OFFLOAD_STORE_MODES, default=d.kv_offloading_store,
                   help="copy a block to host memory when it is evicted from the device, or as soon as it is computed "
                        "(write-through) (default %(default)s)")
    g.add_argument("--kv-offloading-backend", choices=("native", "disk", "mooncake"), default=d.kv_offloading_backend,
                   help="native: the host tier alone; disk or mooncake: also an external tier the worker saves every "
                        "computed block to and loads hits from, off the step path (give the worker the same flag) "
                        "(default %(default)s)")
    g.add_argument("--mooncake-master", metavar="HOST:PORT", help="mooncake: the master the scheduler asks which blocks the store holds")
    g.add_argument("--mooncake-metadata", metavar="URL", help="mooncake: the store's metadata server (http://HOST:PORT/metadata)")
    g = p.add_argument_group("P/D disaggregation (vLLM's KV connector)")
    g.add_argument("--kv-transfer-config", metavar="JSON",
                   help='{"kv_connector": "KVPoolConnector" (or "NixlConnector"), "kv_role": "kv_producer" | "kv_consumer" | '
                        '"kv_both", ...}: prefill engines lend a request\'s blocks, decode engines read them from the '
                        "prefill engine's worker (give the worker the same flag; docs/pd-disaggregation.md)")


def _add_retention_and_event_flags(p: argparse.ArgumentParser, d: SchedulerConfig) -> None:
    """What is evicted first, and the KV events routers read."""
    g = p.add_argument_group("retention (kvpool extensions)")
    g.add_argument("--kv-eviction-policy", choices=KV_EVICTION_POLICIES, default=d.kv_eviction_policy,
                   help="which free cached block is evicted first: lru (vLLM's), arc, lfu, s3fifo or cost; with "
                        "--scheduling-policy priority, lower-priority requests' blocks go first (default %(default)s)")
    g.add_argument("--max-pinned-fraction", type=float, default=d.max_pinned_fraction, metavar="FRACTION",
                   help="share of the pool's blocks that pins (POST /v1/cache/pin) may hold, in [0, 1) (default %(default)s)")
    g = p.add_argument_group("KV events (vLLM's ZMQ format, for KV-aware routers)")
    g.add_argument("--kv-events-endpoint", metavar="ENDPOINT", help="bind a ZMQ PUB socket here and publish KV cache events, e.g. tcp://127.0.0.1:5557")
    g.add_argument("--kv-events-replay-endpoint", metavar="ENDPOINT", help="ROUTER socket serving missed batches, e.g. tcp://127.0.0.1:5558")
    g.add_argument("--kv-events-topic", default=d.kv_events_topic, help="topic frame of every batch (default: empty)")
    g.add_argument("--kv-events-buffer-steps", type=int, default=d.kv_events_buffer_steps, help="batches kept for replay (default %(default)s)")
    g.add_argument("--kv-events-endpoint-mode", choices=ENDPOINT_MODES, default=d.kv_events_endpoint_mode,
                   help="bind: the PUB socket binds the endpoint; vllm: as vLLM's --kv-events-config, it binds a wildcard "
                        "(*), ipc:// or inproc:// endpoint and connects to any other (default %(default)s)")
    g.add_argument("--kv-events-hwm", type=int, default=d.kv_events_hwm, help="the PUB socket's send high-water mark (default %(default)s)")
    g.add_argument("--kv-events-max-queue-size", type=int, default=d.kv_events_max_queue_size,
                   help="vLLM's max_queue_size, reported to routers in /kv_event_sources; kvpool queues no events (default %(default)s)")
    g.add_argument("--kv-events-int-block-hashes", action=argparse.BooleanOptionalAction, default=None,
                   help="block hashes as 64-bit ints, as vLLM 0.33 sends them (the default), or with --no-... the full "
                        f"hash bytes; default from {INT_BLOCK_HASHES_ENV} (1 = ints, 0 = bytes) as in vLLM")
    g.add_argument("--data-parallel-rank", type=int, default=d.data_parallel_rank, metavar="RANK",
                   help="this replica's rank, sent in every batch so an indexer tells replicas apart (default %(default)s)")


def _add_mfu_flags(p: argparse.ArgumentParser, d: SchedulerConfig) -> None:
    p.add_argument("--speculative-config", "-sc", metavar="JSON",
                   help="vLLM's speculative decoding config, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 3}' "
                        "(n-gram drafts: prompt_lookup_min/max, default 5)")
    g = p.add_argument_group("MFU metrics (vllm:estimated_flops_per_gpu_total, _read_bytes_, _write_bytes_)")
    g.add_argument("--enable-mfu-metrics", action="store_true", help="estimate each step's flops and memory traffic per GPU, as vLLM")
    g.add_argument("--model", metavar="DIR", help="the checkpoint the worker serves (its config.json); needed by --enable-mfu-metrics")
    g.add_argument("--dtype", default=d.dtype, choices=["auto", *DTYPE_BYTES],
                   help="the worker's --dtype (auto: the checkpoint's torch_dtype)")


def _check_mfu_flags(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    if a.enable_mfu_metrics and a.model is None:
        p.error("--enable-mfu-metrics needs --model DIR (the checkpoint the worker serves)")
    if a.enable_mfu_metrics:
        try:
            ModelShape.from_checkpoint(a.model, a.dtype, a.kv_cache_dtype)
        except ValueError as e:
            p.error(str(e))


def _check_external_tier(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    backend = a.kv_offloading_backend
    if backend == "native":
        if a.mooncake_master or a.mooncake_metadata:
            p.error("--mooncake-master and --mooncake-metadata are for --kv-offloading-backend mooncake")
        return
    if not a.enable_prefix_caching:
        p.error(f"--kv-offloading-backend {backend} needs the prefix cache: blocks are saved and found by hash (drop --no-enable-prefix-caching)")
    if a.prefix_caching_hash_algo in RANDOMLY_SEEDED_ALGOS and not os.environ.get("PYTHONHASHSEED"):
        p.error(f"--kv-offloading-backend {backend} with --prefix-caching-hash-algo {a.prefix_caching_hash_algo}: vLLM seeds its "
                "xxhash chains at random when PYTHONHASHSEED is unset, so no other process (nor this one restarted) would find "
                "a saved block; set PYTHONHASHSEED, or use kvpool_sha256 or sha256")
    if backend == "mooncake" and not (a.mooncake_master and a.mooncake_metadata):
        p.error("--kv-offloading-backend mooncake needs --mooncake-master HOST:PORT and --mooncake-metadata URL")
    if backend == "disk" and (a.mooncake_master or a.mooncake_metadata):
        p.error("--mooncake-master and --mooncake-metadata are for --kv-offloading-backend mooncake, not disk")


def _check_kv_transfer(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    if a.kv_transfer_config is None:
        return
    try:
        parse_kv_transfer_config(a.kv_transfer_config)
    except ValueError as e:
        p.error(str(e))
    if a.kv_offloading_backend != "native":
        p.error(f"--kv-transfer-config with --kv-offloading-backend {a.kv_offloading_backend} is not supported together yet")


def _check_security(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """CURVE's two files go together; without them only a loopback --host is bound."""
    if (a.curve_secret_key is None) != (a.curve_authorized_keys is None):
        p.error("--curve-secret-key and --curve-authorized-keys go together")
    if a.curve_secret_key is not None:
        try:
            load_keypair(a.curve_secret_key)
        except CurveKeyError as e:
            p.error(str(e))
        if not os.path.isdir(a.curve_authorized_keys):
            p.error(f"--curve-authorized-keys {a.curve_authorized_keys} is not a folder")
    elif not is_loopback(a.host):
        p.error(f"--host {a.host} is not a loopback address: binding it without CURVE authentication is refused "
                "(give --curve-secret-key and --curve-authorized-keys)")


def _check_kv_events(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """The KV events' endpoints and bounds; the block-hash form from the environment when not given."""
    if a.kv_events_replay_endpoint is not None and a.kv_events_endpoint is None:
        p.error("--kv-events-replay-endpoint needs --kv-events-endpoint")
    if a.kv_events_buffer_steps < 1 or a.kv_events_hwm < 1 or a.kv_events_max_queue_size < 1:
        p.error("--kv-events-buffer-steps, --kv-events-hwm and --kv-events-max-queue-size must be positive")
    if a.kv_events_int_block_hashes is None:
        try:
            a.kv_events_int_block_hashes = int_block_hashes_from_env(os.environ)
        except ValueError as e:
            p.error(str(e))
    for flag, ep in (("--kv-events-endpoint", a.kv_events_endpoint), ("--kv-events-replay-endpoint", a.kv_events_replay_endpoint)):
        if ep is not None:
            try:
                if flag == "--kv-events-endpoint" and not is_bind_endpoint(ep, a.kv_events_endpoint_mode):
                    check_connect_endpoint(ep, flag)
                else:
                    check_local_endpoint(ep, flag, allow_remote=a.curve_secret_key is not None)
            except ValueError as e:
                p.error(str(e))


def config_from_args(argv: list[str] | None = None) -> SchedulerConfig:
    p = build_parser()
    a = p.parse_args(argv)
    if a.async_scheduling:
        p.error(ASYNC_SCHEDULING_REFUSED)
    del a.async_scheduling
    if a.max_num_batched_tokens is None:
        # vLLM's default, raised to max_model_len without chunked prefill.
        a.max_num_batched_tokens = SchedulerConfig().max_num_batched_tokens
        if not a.enable_chunked_prefill:
            a.max_num_batched_tokens = max(a.max_model_len, a.max_num_batched_tokens)
    for name in ("port", "worker_port", "http_port"):
        value = getattr(a, name)
        if not 0 <= value <= 65535:
            p.error(f"--{name.replace('_', '-')} must be a port number, got {value}")
    for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "max_frame_bytes", "max_num_waiting"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(a, name)}")
    try:
        check_one_group_args(a)
        check_scheduler_options(a.max_num_seqs, a.max_num_batched_tokens, a.max_model_len, enable_chunked_prefill=a.enable_chunked_prefill,
                                long_prefill_token_threshold=a.long_prefill_token_threshold, watermark=a.watermark,
                                max_num_scheduled_tokens=a.max_num_scheduled_tokens, max_num_active_seqs=a.max_num_active_seqs)
    except ValueError as e:
        p.error(str(e))
    if a.num_gpu_blocks_override is not None and a.num_gpu_blocks_override < 2:
        p.error(f"--num-gpu-blocks-override must be at least 2 (block 0 is the null block), got {a.num_gpu_blocks_override}")
    if a.worker_timeout_s <= 0 or a.worker_reconnect_timeout_s <= 0:
        p.error("--worker-timeout and --worker-reconnect-timeout must be positive")
    _check_security(p, a)
    _check_kv_events(p, a)
    if a.data_parallel_rank < 0:
        p.error(f"--data-parallel-rank must be non-negative, got {a.data_parallel_rank}")
    if not 0.0 <= a.kv_offloading_size < float("inf"):
        p.error(f"--kv-offloading-size must be a size in GiB, 0 or more, got {a.kv_offloading_size}")
    if a.kv_offloading_size > 0 and not a.enable_prefix_caching:
        p.error("--kv-offloading-size needs the prefix cache: blocks are offloaded and found by hash (drop --no-enable-prefix-caching)")
    _check_external_tier(p, a)
    _check_kv_transfer(p, a)
    _check_mfu_flags(p, a)
    try:
        spec = parse_speculative_config(a.speculative_config)
    except ValueError as e:
        p.error(f"--speculative-config: {e}")
    a.speculative_config = None if spec is None else spec.to_json()
    if not 0.0 <= a.max_pinned_fraction < 1.0:
        p.error(f"--max-pinned-fraction must be in [0, 1), got {a.max_pinned_fraction}")
    if not 0.0 < a.kv_cache_metrics_sample <= 1.0:
        p.error(f"--kv-cache-metrics-sample must be in (0, 1], got {a.kv_cache_metrics_sample}")
    try:
        a.log_stats_interval_s = float(os.environ.get("VLLM_LOG_STATS_INTERVAL", "10"))
    except ValueError:
        a.log_stats_interval_s = -1.0
    if not 0 < a.log_stats_interval_s < float("inf"):
        p.error(f"VLLM_LOG_STATS_INTERVAL must be a positive number of seconds, got {os.environ.get('VLLM_LOG_STATS_INTERVAL')!r}")
    a.python_hash_seed = os.environ.get("PYTHONHASHSEED")
    return SchedulerConfig(**vars(a))
