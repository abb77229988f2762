"""The worker process's configuration: one frozen dataclass, built from argparse in
``worker.__main__`` and read only by the process loop, which hands plain values to
the objects it builds."""

from __future__ import annotations

from dataclasses import dataclass

from protocol.kv_cache_spec import DEFAULT_BLOCK_SIZE
from protocol.kv_transfer_config import KVTransferConfig
from worker.cpu.threads import DEFAULT_CPU_NICE

CPU_DEFAULT_KV_CACHE_MEMORY = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    scheduler: str = "tcp://127.0.0.1:5556"
    # A Hugging Face checkpoint directory; None: the tiny default checkpoint.
    model: str | None = None
    device: str = "cpu"
    dtype: str = "auto"  # auto: the checkpoint's torch_dtype
    # The KV tensors' dtype (vLLM's --kv-cache-dtype): auto, the model's; or an fp8 format.
    kv_cache_dtype: str = "auto"
    # None: the model's max_position_embeddings.
    max_model_len: int | None = None
    # vLLM's --disable-sliding-window: every layer full attention, the context capped at the window.
    disable_sliding_window: bool = False
    # vLLM's --disable-hybrid-kv-cache-manager: one full KV-cache group (layers still attend within their windows).
    disable_hybrid_kv_cache_manager: bool = False
    # Bytes for the KV cache; None means: on CUDA a share of device memory
    # (gpu_memory_utilization), on CPU CPU_DEFAULT_KV_CACHE_MEMORY.
    kv_cache_memory: int | None = None
    # vLLM's --num-gpu-blocks-override: exactly this many KV blocks, whatever the budget
    # above would hold (refused only when the device cannot hold them).
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9
    # Tokens of the dummy step that profiles the activation peak on CUDA, and the rows
    # its logits and sampler pass take (the scheduler's --max-num-seqs).
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    block_size: int = DEFAULT_BLOCK_SIZE
    # GiB of host memory for the offload tier (vLLM's --kv-offloading-size); 0: none.
    kv_offloading_size: float = 0.0
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
    seed: int = 0
    http_port: int = 8001  # 0 disables /metrics
    # The model_name label of the worker's metrics: the name the API serves it under.
    served_model_name: str = "kvpool-tiny"
    log_level: str = "INFO"
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
    tensor_parallel_size: int = 1
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
