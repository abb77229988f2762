"""The scheduler's command line: its parser and the one frozen SchedulerConfig built
from it (a bad flag exits 2 with argparse's usage and the reason).

The settings ``kvpool serve`` gives the scheduler are the settings table's rows
(protocol/serve_flags/): declared there once, added here; the rest are the
scheduler's own.
"""

from __future__ import annotations

import argparse
import os

from protocol.kv_events import INT_BLOCK_HASHES_ENV
from protocol.serve_flags import SCHEDULER, rows_for
from protocol.serve_flags.flag import add_flag, unaccepted
from protocol.serve_flags.model import one_name
from protocol.speculative_config import parse_speculative_config
from scheduler.core.kv_cache_manager import OFFLOAD_STORE_MODES
from scheduler.engine.arg_checks import (
    check_external_tier,
    check_kv_events,
    check_kv_transfer,
    check_mfu_flags,
    check_security,
)
from scheduler.engine.config import SchedulerConfig
from scheduler.engine.kv_event_endpoints import ENDPOINT_MODES
from scheduler.engine.metric_buckets import custom_histogram_buckets
from scheduler.engine.one_group_flags import check_one_group_args
from scheduler.sched.policy_options import check_scheduler_options

# vLLM's async scheduling plans step N+1 before step N's result is in; kvpool plans a
# step only once the previous result is applied (DESIGN.md rule 3: blocks are cached
# at scheduling time), so --async-scheduling is refused as vLLM refuses it where its
# executor cannot (``does not support async scheduling yet``).
ASYNC_SCHEDULING_REFUSED = (
    "--async-scheduling: kvpool's scheduler does not support async scheduling yet: it plans a step only after the "
    "previous step's result is applied (drop the flag, or pass --no-async-scheduling)"
)
# The table's rows the scheduler's config names otherwise.
DESTS = {"served_model_name": "model_name"}
# The table's rows whose value only the scheduler can check (its own histogram families).
OWN_TYPES = {"custom_histogram_buckets": custom_histogram_buckets}


def build_parser() -> argparse.ArgumentParser:
    d = SchedulerConfig()
    p = argparse.ArgumentParser(prog="kvpool-scheduler", description="kvpool scheduler: owns the BlockPool and schedules steps for the worker.")
    p.add_argument("--host", default=d.host, help="address every socket binds (default %(default)s)")
    p.add_argument("--port", type=int, default=d.port, help="client ROUTER port (default %(default)s)")
    p.add_argument("--worker-port", type=int, default=d.worker_port, help="worker ROUTER port (default %(default)s)")
    p.add_argument("--http-port", type=int, default=d.http_port, help="/metrics, /health (default %(default)s)")
    g = p.add_argument_group("kvpool serve's settings (protocol/serve_flags/)")
    for row in rows_for(SCHEDULER):
        add_flag(g, row, DESTS.get(row.dest), OWN_TYPES.get(row.dest))
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="not supported: kvpool plans a step once the previous one's result is in (--no-async-scheduling is accepted)")
    p.add_argument("--max-num-waiting", type=int, default=d.max_num_waiting,
                   help="most requests waiting to run; more are refused (default %(default)s, ~36 bytes a prompt token each)")
    _add_link_flags(p, d)
    _add_tier_flags(p, d)
    _add_retention_and_event_flags(p, d)
    return p


def _add_link_flags(p: argparse.ArgumentParser, d: SchedulerConfig) -> None:
    """The worker's liveness, the client frames' bound, and CURVE."""
    p.add_argument("--worker-timeout", dest="worker_timeout_s", type=float, default=d.worker_timeout_s, metavar="SECONDS",
                   help="a worker silent this long is taken for dead (default %(default)s)")
    p.add_argument("--worker-reconnect-timeout", dest="worker_reconnect_timeout_s", type=float, default=d.worker_reconnect_timeout_s,
                   metavar="SECONDS", help="with no worker this long, waiting requests fail (default %(default)s)")
    p.add_argument("--max-frame-bytes", type=int, default=d.max_frame_bytes,
                   help="largest client frame answered (default %(default)s); a peer sending 4x this is disconnected")
    g = p.add_argument_group("security (ZeroMQ CURVE; required to bind a non-loopback --host)")
    g.add_argument("--curve-secret-key", metavar="FILE", help="the scheduler's secret certificate (NAME.key_secret, see `python -m protocol.curve`)")
    g.add_argument("--curve-authorized-keys", metavar="DIR", help="folder of the public certificates of allowed workers and clients")


def _add_tier_flags(p: argparse.ArgumentParser, d: SchedulerConfig) -> None:
    """The tiers below the device pool (their size, backend and store: the table's rows)."""
    g = p.add_argument_group("offload tier (vLLM's native CPU offloading)")
    g.add_argument("--kv-offloading-store", choices=OFFLOAD_STORE_MODES, default=d.kv_offloading_store,
                   help="copy a block to host memory when it is evicted from the device, or as soon as it is computed "
                        "(write-through) (default %(default)s)")


def _add_retention_and_event_flags(p: argparse.ArgumentParser, d: SchedulerConfig) -> None:
    """What is evicted first, and the KV events routers read."""
    g = p.add_argument_group("retention (kvpool extensions)")
    g = p.add_argument_group("KV events (vLLM's ZMQ format, for KV-aware routers)")
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


def _settle(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """The table's values the scheduler reads its own way: not given (None) as its
    defaults, one model name, the stats line on unless --disable-log-stats."""
    d = SchedulerConfig()
    for row in rows_for(SCHEDULER):
        if (line := unaccepted(row, getattr(a, DESTS.get(row.dest, row.dest)))) is not None:
            p.error(line)
    if a.async_scheduling:
        p.error(ASYNC_SCHEDULING_REFUSED)
    del a.async_scheduling
    a.model_name = one_name(a.model_name) or d.model_name
    # NOTE: VLLM_SERVER_DEV_MODE as well (vLLM's switch; the frontend reads it too, so
    # one variable given to `kvpool serve` opens /reset_prefix_cache end to end).
    a.dev_mode = a.dev_mode or os.environ.get("KVPOOL_DEV_MODE") == "1" or \
        os.environ.get("VLLM_SERVER_DEV_MODE", "0").strip() not in ("", "0")
    a.log_stats = not a.disable_log_stats
    del a.disable_log_stats
    if a.max_model_len is None:
        a.max_model_len = d.max_model_len
    if a.max_num_batched_tokens is None:
        # vLLM's default, raised to max_model_len without chunked prefill.
        a.max_num_batched_tokens = d.max_num_batched_tokens
        if not a.enable_chunked_prefill:
            a.max_num_batched_tokens = max(a.max_model_len, a.max_num_batched_tokens)
    try:
        spec = parse_speculative_config(a.speculative_config)
    except ValueError as e:
        p.error(f"--speculative-config: {e}")
    a.speculative_config = None if spec is None else spec.to_json()
    try:
        a.log_stats_interval_s = float(os.environ.get("VLLM_LOG_STATS_INTERVAL", "10"))
    except ValueError:
        a.log_stats_interval_s = -1.0
    if not 0 < a.log_stats_interval_s < float("inf"):
        p.error(f"VLLM_LOG_STATS_INTERVAL must be a positive number of seconds, got {os.environ.get('VLLM_LOG_STATS_INTERVAL')!r}")
    a.python_hash_seed = os.environ.get("PYTHONHASHSEED")


def _check_sizes(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
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
    if a.data_parallel_rank < 0:
        p.error(f"--data-parallel-rank must be non-negative, got {a.data_parallel_rank}")
    if not 0.0 <= a.max_pinned_fraction < 1.0:
        p.error(f"--max-pinned-fraction must be in [0, 1), got {a.max_pinned_fraction}")
    if not 0.0 < a.kv_cache_metrics_sample <= 1.0:
        p.error(f"--kv-cache-metrics-sample must be in (0, 1], got {a.kv_cache_metrics_sample}")


def config_from_args(argv: list[str] | None = None) -> SchedulerConfig:
    p = build_parser()
    a = p.parse_args(argv)
    _settle(p, a)
    _check_sizes(p, a)
    check_security(p, a)
    check_kv_events(p, a)
    if a.kv_offloading_size > 0 and not a.enable_prefix_caching:
        p.error("--kv-offloading-size needs the prefix cache: blocks are offloaded and found by hash (drop --no-enable-prefix-caching)")
    check_external_tier(p, a)
    check_kv_transfer(p, a)
    model_shape = check_mfu_flags(p, a)
    return SchedulerConfig(**vars(a), model_shape=model_shape)
