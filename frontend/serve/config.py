"""``kvpool serve``'s one frozen config: the settled flags, built once from the
command line (``frontend.serve.cli.parse_serve``) and read by the launcher and the
children's argv (``frontend.serve.child_argv``).

A field holds a flag's value under the flag's name (its ``dest``); the flags'
defaults are the table's (protocol/serve_flags/, frontend/serve/flags/), never
written here. The ``vllm serve`` flags kvpool serve only passes on or accepts are in
``given``, as given."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class ServeConfig:
    # The model, as given and as the folder every process reads.
    model: str
    model_dir: Path
    served_model_name: str
    max_model_len: int
    dtype: str
    seed: int
    disable_sliding_window: bool
    generation_config: str
    # The KV cache and its tiers.
    block_size: int
    kv_cache_dtype: str
    num_gpu_blocks_override: int | None
    gpu_memory_utilization: float
    kv_cache_memory: str | None
    kv_cache_memory_bytes: int | None
    enable_prefix_caching: bool
    prefix_caching_hash_algo: str
    kv_offloading_size: float
    kv_offloading_backend: str
    kv_offloading_path: str | None
    kv_offloading_disk_size: float | None
    mooncake_master: str | None
    mooncake_metadata: str | None
    kv_eviction_policy: str
    max_pinned_fraction: float
    # What runs in a step, and on what.
    max_num_seqs: int
    max_num_batched_tokens: int
    scheduler_reserve_full_isl: bool
    tensor_parallel_size: int
    distributed_timeout_seconds: float | None
    device: str | None
    cpu_nice: int | None
    cpu_wide_step_tokens: int | None
    # Speculative decoding, P/D and KV events, checked: each child is given these.
    speculative_config: str | None
    kv_transfer_config: str | None
    kv_events_endpoint: str | None
    kv_events_replay_endpoint: str | None
    kv_events_topic: str
    kv_events_flags: tuple[str, ...]
    # Logs and metrics.
    log_level: str
    disable_log_stats: bool
    kv_cache_metrics: bool
    enable_mfu_metrics: bool
    enable_log_requests: bool
    log_dir: str | None
    # The API.
    host: str
    port: int
    return_tokens_as_token_ids: bool
    max_request_body_bytes: int
    dev_mode: bool
    # The supervisor.
    worker_http_port: int | None
    worker_restarts: int
    scheduler_restarts: int
    frontend_restarts: int
    worker_restart_timeout: float
    ready_timeout: float
    stop_timeout: float
    scheduler_args: tuple[str, ...]
    worker_args: tuple[str, ...]
    # vllm serve's flags kvpool serve passes on or accepts, by dest, when given.
    given: dict[str, Any]

    @classmethod
    def from_values(cls, values: dict[str, Any], given: dict[str, Any]) -> ServeConfig:
        """The config of the settled ``values`` (a flag's dest -> its value; others are ignored)."""
        kept = {f.name: values[f.name] for f in fields(cls) if f.name != "given"}
        for name in ("scheduler_args", "worker_args", "kv_events_flags"):
            kept[name] = tuple(kept[name])
        return cls(**kept, given=given)
