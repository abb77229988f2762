"""``kvpool serve``'s flags settled: the values that depend on MODEL or on other flags
(``settled_values``), then the checks of the whole (``check_config``), before any
process starts. A bad value exits 2 with argparse's usage and the reason."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from frontend.serve.config import ServeConfig
from frontend.serve.flags.kv_events_config import kv_events_scheduler_flags
from frontend.serve.flags.speculative import settled_speculative_config
from frontend.serve.model_dir import config_json
from protocol.serve_flags.model import one_name

# NOTE: vLLM takes max_position_embeddings whole; kvpool serve caps --max-model-len at
# this, the scheduler's own default, so a chat request without max_tokens fits a small pool.
MAX_MODEL_LEN_CAP = 4096
# vLLM's --max-num-batched-tokens default with chunked prefill.
MAX_NUM_BATCHED_TOKENS = 2048


def _model_config(model_dir: Path) -> dict:
    try:
        config = config_json(model_dir)
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def max_position_embeddings(model_dir: Path) -> int | None:
    try:
        return int(_model_config(model_dir)["max_position_embeddings"])
    except (KeyError, TypeError, ValueError):
        return None


def sliding_window(model_dir: Path) -> int | None:
    """The model's attention window, None without one (Qwen2/Qwen3 carry a window that
    is off unless use_sliding_window, as the worker reads it)."""
    config = _model_config(model_dir)
    window = config.get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1 or config.get("use_sliding_window", True) is False:
        return None
    return window


def _max_model_len(p: argparse.ArgumentParser, a: argparse.Namespace, model_dir: Path) -> int:
    window = sliding_window(model_dir) if a.disable_sliding_window else None
    if a.max_model_len is not None:
        if window is not None and a.max_model_len > window:
            p.error(f"--max-model-len {a.max_model_len} is longer than the model's sliding window {window} (--disable-sliding-window)")
        return a.max_model_len
    cap = MAX_MODEL_LEN_CAP
    return min(max_position_embeddings(model_dir) or cap, cap, window or cap)


def settled_values(p: argparse.ArgumentParser, a: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    """The flags whose value depends on MODEL or on other flags, as each child is given them."""
    max_model_len = _max_model_len(p, a, model_dir)
    max_num_batched_tokens = a.max_num_batched_tokens
    if max_num_batched_tokens is None:
        # NOTE: vLLM's default; unchunked, a step must hold a whole prompt.
        chunked = getattr(a, "enable_chunked_prefill", True)
        max_num_batched_tokens = MAX_NUM_BATCHED_TOKENS if chunked else max(max_model_len, MAX_NUM_BATCHED_TOKENS)
    try:
        speculative_config = settled_speculative_config(a.speculative_config, a.spec_method, a.spec_model, a.spec_tokens)
    except ValueError as e:
        p.error(str(e))
    kv_events_flags: list[str] = []
    if a.kv_events_config is not None:
        if a.kv_events_endpoint is not None:
            p.error("--kv-events-config and --kv-events-endpoint both configure the KV events publisher: give one")
        try:
            kv_events_flags = kv_events_scheduler_flags(a.kv_events_config, 0, a.scheduler_args)
        except ValueError as e:
            p.error(str(e))
    return {"model_dir": model_dir, "served_model_name": one_name(a.served_model_name) or a.model, "max_model_len": max_model_len,
            "max_num_batched_tokens": max_num_batched_tokens, "speculative_config": speculative_config,
            "kv_events_flags": kv_events_flags}


def _check_external_tier(p: argparse.ArgumentParser, c: ServeConfig) -> None:
    """--kv-offloading-backend disk or mooncake and the flags each needs (and no other's)."""
    backend = c.kv_offloading_backend
    disk_flags, store_flags = (c.kv_offloading_path, c.kv_offloading_disk_size), (c.mooncake_master, c.mooncake_metadata)
    if backend == "disk":
        if not c.kv_offloading_path or not c.kv_offloading_disk_size or c.kv_offloading_disk_size <= 0:
            p.error("--kv-offloading-backend disk needs --kv-offloading-path DIR and --kv-offloading-disk-size GIB (> 0)")
    elif any(v is not None for v in disk_flags):
        p.error(f"--kv-offloading-path and --kv-offloading-disk-size are for --kv-offloading-backend disk, not {backend}")
    if backend == "mooncake":
        if not all(store_flags):
            p.error("--kv-offloading-backend mooncake needs --mooncake-master HOST:PORT and --mooncake-metadata URL")
    elif any(v is not None for v in store_flags):
        p.error(f"--mooncake-master and --mooncake-metadata are for --kv-offloading-backend mooncake, not {backend}")
    if backend != "native" and not c.enable_prefix_caching:
        p.error(f"--kv-offloading-backend {backend} needs the prefix cache: blocks are saved and found by hash")


def _check_supervisor(p: argparse.ArgumentParser, c: ServeConfig) -> None:
    """kvpool serve's own flags: restarts, timeouts, the worker's CPU knobs, the API's limits."""
    for name in ("worker_restarts", "scheduler_restarts", "frontend_restarts"):
        if getattr(c, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(c, name)}")
    if not 0 < c.worker_restart_timeout < float("inf"):
        p.error(f"--worker-restart-timeout must be a positive number of seconds, got {c.worker_restart_timeout}")
    if not 0.0 <= c.max_pinned_fraction < 1.0:
        p.error(f"--max-pinned-fraction must be in [0, 1), got {c.max_pinned_fraction}")
    if c.cpu_nice is not None and not 0 <= c.cpu_nice <= 19:
        p.error(f"--cpu-nice must be 0..19 (a nice value; lowering the priority needs no privilege), got {c.cpu_nice}")
    if c.cpu_wide_step_tokens is not None and c.cpu_wide_step_tokens < 0:
        p.error(f"--cpu-wide-step-tokens must be >= 0 (0: never), got {c.cpu_wide_step_tokens}")
    if c.max_request_body_bytes < 1:
        p.error(f"--max-request-body-bytes must be positive, got {c.max_request_body_bytes}")


def check_config(p: argparse.ArgumentParser, c: ServeConfig) -> None:
    """The settled config's values, together (p.error: exit 2)."""
    if c.given.get("enable_auto_tool_choice") and not c.given.get("tool_call_parser"):
        p.error("--enable-auto-tool-choice requires --tool-call-parser")  # NOTE: vLLM's check, before anything starts
    for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "tensor_parallel_size"):
        if getattr(c, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(c, name)}")
    _check_external_tier(p, c)
    _check_supervisor(p, c)
    if c.given.get("enable_log_outputs") and not c.enable_log_requests:
        p.error("--enable-log-outputs requires --enable-log-requests")  # NOTE: vLLM's check, before anything starts
    if c.kv_cache_memory is not None and c.kv_cache_memory_bytes is not None:
        p.error("--kv-cache-memory-bytes and --kv-cache-memory both size the KV cache: give one")
    if c.kv_cache_memory_bytes is not None and c.kv_cache_memory_bytes < 1:
        p.error(f"--kv-cache-memory-bytes must be positive, got {c.kv_cache_memory_bytes}")
