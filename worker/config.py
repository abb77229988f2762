"""The worker process's configuration: one frozen dataclass, built from argparse in
``worker.__main__`` and read only by the process loop, which hands plain values to
the objects it builds. A setting ``kvpool serve`` gives the worker takes its default
from the settings table's row (protocol/serve_flags/)."""

from __future__ import annotations

from dataclasses import dataclass

from protocol.kv_transfer_config import KVTransferConfig
from protocol.serve_flags.cache import (
    BLOCK_SIZE,
    GPU_MEMORY_UTILIZATION,
    KV_CACHE_DTYPE,
    KV_OFFLOADING_SIZE,
)
from protocol.serve_flags.engine import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    LOG_LEVEL,
    MAX_NUM_SEQS,
    TENSOR_PARALLEL_SIZE,
)
from protocol.serve_flags.model import (
    DEFAULT_SERVED_MODEL_NAME,
    DISABLE_SLIDING_WINDOW,
    DTYPE,
    SEED,
)
from protocol.serve_flags.scheduling import DISABLE_HYBRID_KV_CACHE_MANAGER
from worker.cpu.threads import DEFAULT_CPU_NICE

CPU_DEFAULT_KV_CACHE_MEMORY = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    scheduler: str = "tcp://127.0.0.1:5556"
    # A Hugging Face checkpoint directory; None: the tiny default checkpoint.
    model: str | None = None
    device: str = "cpu"
    dtype: str = DTYPE.default  # auto: the checkpoint's torch_dtype
    # The KV tensors' dtype (vLLM's --kv-cache-dtype): auto, the model's; or an fp8 format.
    kv_cache_dtype: str = KV_CACHE_DTYPE.default
    # None: the model's max_position_embeddings.
    max_model_len: int | None = None
    # vLLM's --disable-sliding-window: every layer full attention, the context capped at the window.
    disable_sliding_window: bool = DISABLE_SLIDING_WINDOW.default
    # vLLM's --disable-hybrid-kv-cache-manager: one full KV-cache group (layers still attend within their windows).
    disable_hybrid_kv_cache_manager: bool = DISABLE_HYBRID_KV_CACHE_MANAGER.default
    # Bytes for the KV cache; None means: on CUDA a share of device memory
    # (gpu_memory_utilization), on CPU CPU_DEFAULT_KV_CACHE_MEMORY.
    kv_cache_memory: int | None = None
    # vLLM's --num-gpu-blocks-override: exactly this many KV blocks, whatever the budget
    # above would hold (refused only when the device cannot hold them).
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION.default
    # Tokens of the dummy step that profiles the activation peak on CUDA, and the rows
    # its logits and sampler pass take (the scheduler's --max-num-seqs).
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = MAX_NUM_SEQS.default
    block_size: int = BLOCK_SIZE.default
    # GiB of host memory for the offload tier (vLLM's --kv-offloading-size); 0: none.
    kv_offloading_size: float = KV_OFFLOADING_SIZE.default
    # The external KV tier (worker/external/): "" none, "disk" (a directory bounded in bytes)
    # or "mooncake" (a Mooncake Store: its master and metadata server).
    kv_offloading_backend: str = ""
    kv_offloading_path: str | None = None
    kv_offloading_disk_bytes: int = 0
    mooncake_master: str | None = None
    mooncake_metadata: str | None = None
    # P/D disaggregation (--kv-transfer-config, worker/transfer/): the role and side channel; None: none.
    kv_transfer: KVTransferConfig | None = None
    # The global sampling seed (vLLM's --seed, default 0 as in vLLM v1): the noise of
    # every request without a seed of its own.
    seed: int = SEED.default
    http_port: int = 8001  # 0 disables /metrics
    # The model_name label of the worker's metrics: the name the API serves it under.
    served_model_name: str = DEFAULT_SERVED_MODEL_NAME
    log_level: str = LOG_LEVEL.default
    # NOTE: the same as the scheduler's --worker-timeout (docs/operations.md, "Liveness").
    scheduler_timeout_s: float = 10.0
    heartbeat_interval_s: float = 0.5
    reconnect: bool = False
    # CURVE: this worker's secret certificate and the scheduler's public one.
    curve_client_key: str | None = None
    curve_server_key: str | None = None
    # Tensor parallelism: ranks in the group, this process's rank (None: rank 0, which
    # starts the others on this host), rank 0's store address (None: a free loopback
    # port), and how long a collective may wait for another rank.
    tensor_parallel_size: int = TENSOR_PARALLEL_SIZE.default
    rank: int | None = None
    distributed_init_method: str | None = None
    distributed_timeout_s: float = 30.0
    # On CPU every thread of the worker runs at this nice value at least (--cpu-nice).
    cpu_nice: int = DEFAULT_CPU_NICE
    # On CPU a step of at least this many tokens runs on every core (0: never; None: from
    # the model's size, worker.cpu.threads.wide_step_tokens).
    cpu_wide_step_tokens: int | None = None
    # The pid of the `kvpool serve` that started this worker: its CPU time and its other
    # children's are this serve's, not a neighbour's (worker/cpu/host_load.py).
    serve_pid: int | None = None
