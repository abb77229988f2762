"""What ``kvpool serve`` gives each child process: its argv, from the settled
arguments (``frontend.serve.cli.parse_serve``) and the internal ports chosen free.

Flags the table marks ``passed`` (``frontend.serve.flags``) go to their child under
the same name, as given; the rest are mapped here, flag by flag."""

from __future__ import annotations

import os
import sys

from frontend.serve.flags import all_rules
from frontend.serve.flags.rules import PASSED, forwarded


def passed_flags(a, child: str) -> list[str]:
    """The ``passed`` flags given for ``child``, in the table's order."""
    rules = all_rules()
    return [arg for rule in rules if rule.verdict == PASSED and child in rule.to for arg in forwarded(rule, a)]


def _log_level(a) -> list[str]:
    return ["--log-level", a.log_level] if getattr(a, "log_level", None) else []


def _kv_cache_dtype(a) -> list[str]:
    # NOTE: both sides: the worker allocates and quantizes, the scheduler reports the name.
    name = getattr(a, "kv_cache_dtype", None) or "auto"
    return [] if name == "auto" else ["--kv-cache-dtype", name]


def _offload(a) -> list[str]:
    # NOTE: both sides: the worker allocates the host tier, the scheduler manages it.
    return ["--kv-offloading-size", f"{a.kv_offloading_size:g}"] if getattr(a, "kv_offloading_size", 0) else []


def _external(a, child: str) -> list[str]:
    """The external tier (--kv-offloading-backend disk or mooncake): both sides name it; the
    worker holds the directory or the store's client, the scheduler asks the master too."""
    backend = getattr(a, "kv_offloading_backend", None) or "native"
    if backend == "native":
        return []
    argv = ["--kv-offloading-backend", backend]
    if backend == "mooncake":
        argv += ["--mooncake-master", a.mooncake_master, "--mooncake-metadata", a.mooncake_metadata]
    elif child == "worker":
        argv += ["--kv-offloading-path", a.kv_offloading_path, "--kv-offloading-disk-size", f"{a.kv_offloading_disk_size:g}"]
    return argv


def _kv_transfer(a) -> list[str]:
    # NOTE: all three: the scheduler and the worker move the blocks, the API server reads
    # requests' kv_transfer_params; the same JSON, so one engine_id (frontend.serve.cli settles it).
    return ["--kv-transfer-config", a.kv_transfer_config] if getattr(a, "kv_transfer_config", None) else []


def scheduler_argv(a, client_port: int, worker_port: int, sched_http: int) -> list[str]:
    sched = [sys.executable, "-m", "scheduler", "--host", "127.0.0.1", "--port", str(client_port), "--worker-port", str(worker_port),
             "--http-port", str(sched_http), "--block-size", str(a.block_size), "--served-model-name", a.served_model_name,
             "--max-model-len", str(a.max_model_len), "--max-num-seqs", str(a.max_num_seqs),
             "--max-num-batched-tokens", str(a.max_num_batched_tokens), "--worker-reconnect-timeout", str(a.worker_restart_timeout)]
    if a.num_gpu_blocks_override is not None:
        sched += ["--num-gpu-blocks-override", str(a.num_gpu_blocks_override)]
    if getattr(a, "kv_eviction_policy", "lru") != "lru":
        sched += ["--kv-eviction-policy", a.kv_eviction_policy]
    if getattr(a, "max_pinned_fraction", 0.5) != 0.5:
        sched += ["--max-pinned-fraction", f"{a.max_pinned_fraction!r}"]
    sched += _kv_cache_dtype(a)
    if getattr(a, "prefix_caching_hash_algo", None):
        sched += ["--prefix-caching-hash-algo", a.prefix_caching_hash_algo]
    flags = {"--no-enable-prefix-caching": not a.enable_prefix_caching,
             "--no-scheduler-reserve-full-isl": not getattr(a, "scheduler_reserve_full_isl", True),
             "--dev-mode": a.dev_mode, "--disable-log-stats": a.disable_log_stats, "--kv-cache-metrics": a.kv_cache_metrics}
    sched += [flag for flag, on in flags.items() if on]
    if getattr(a, "enable_mfu_metrics", False):
        # NOTE: the scheduler estimates from the checkpoint's shape in the worker's dtype.
        sched += ["--enable-mfu-metrics", "--model", str(a.model_dir), "--dtype", a.dtype]
    sched += _offload(a) + _external(a, "scheduler") + _kv_transfer(a) + _log_level(a)
    for flag, value in (("--kv-events-endpoint", a.kv_events_endpoint), ("--kv-events-replay-endpoint", a.kv_events_replay_endpoint),
                        ("--kv-events-topic", a.kv_events_topic)):
        if value:
            sched += [flag, value]
    sched += getattr(a, "kv_events_flags", [])
    sched += getattr(a, "speculative_flags", [])
    return sched + passed_flags(a, "scheduler") + a.scheduler_args


def worker_argv(a, worker_port: int, worker_http: int) -> list[str]:
    # NOTE: --reconnect: a scheduler that died is restarted; the worker handshakes with the next one.
    worker = [sys.executable, "-m", "worker", "--scheduler", f"tcp://127.0.0.1:{worker_port}", "--reconnect", "--model", str(a.model_dir),
              "--block-size", str(a.block_size), "--max-model-len", str(a.max_model_len), "--dtype", a.dtype,
              "--http-port", str(worker_http), "--gpu-memory-utilization", str(a.gpu_memory_utilization),
              "--max-num-batched-tokens", str(a.max_num_batched_tokens), "--max-num-seqs", str(a.max_num_seqs), "--seed", str(a.seed),
              "--served-model-name", a.served_model_name]
    if a.device:
        worker += ["--device", a.device]
    worker += _kv_cache_dtype(a)
    if getattr(a, "disable_sliding_window", False):
        worker.append("--disable-sliding-window")
    if a.num_gpu_blocks_override is not None:
        # NOTE: both sides: the worker allocates exactly N blocks (as vLLM), the scheduler pools them.
        worker += ["--num-gpu-blocks-override", str(a.num_gpu_blocks_override)]
    if a.kv_cache_memory:
        worker += ["--kv-cache-memory", a.kv_cache_memory]
    elif getattr(a, "kv_cache_memory_bytes", None):
        worker += ["--kv-cache-memory", str(a.kv_cache_memory_bytes)]
    worker += _offload(a) + _external(a, "worker") + _kv_transfer(a) + _log_level(a)
    if a.tensor_parallel_size > 1:
        worker += ["--tensor-parallel-size", str(a.tensor_parallel_size)]
    if getattr(a, "distributed_timeout_seconds", None) is not None:
        worker += ["--distributed-timeout", f"{a.distributed_timeout_seconds:g}"]
    for flag, value in (("--cpu-nice", getattr(a, "cpu_nice", None)), ("--cpu-wide-step-tokens", getattr(a, "cpu_wide_step_tokens", None))):
        if value is not None:
            worker += [flag, str(value)]
    # NOTE: the launcher builds the argv: the worker's parent, whose CPU use and other
    # children's (scheduler, frontend) are not a neighbour's (worker/host_load.py).
    worker += ["--serve-pid", str(os.getpid())]
    return worker + passed_flags(a, "worker") + a.worker_args


def frontend_argv(a, client_port: int, scheduler_http: str) -> list[str]:
    front = [sys.executable, "-m", "frontend", "--model", str(a.model_dir), "--served-model-name", a.served_model_name,
             "--host", a.host, "--port", str(a.port), "--scheduler", f"tcp://127.0.0.1:{client_port}",
             "--scheduler-http", scheduler_http, "--max-model-len", str(a.max_model_len),
             "--generation-config", a.generation_config, "--max-request-body-bytes", str(a.max_request_body_bytes),
             "--scheduler-restart-timeout", f"{a.worker_restart_timeout:g}"]
    flags = {"--dev-mode": a.dev_mode, "--enable-log-requests": a.enable_log_requests,
             "--return-tokens-as-token-ids": a.return_tokens_as_token_ids}
    return front + [flag for flag, on in flags.items() if on] + _kv_transfer(a) + _log_level(a) + passed_flags(a, "frontend")
