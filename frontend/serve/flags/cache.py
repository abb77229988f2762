"""``vllm serve``'s CacheConfig and OffloadConfig groups: the KV cache, its prefix cache
and the host-memory tier."""

from __future__ import annotations

from frontend.serve.flags import reasons as why
from frontend.serve.flags.rules import BOOL, MANY, ONE, Group, declared, handled, passed, refused
from frontend.serve.flags.values import human_readable_int
from protocol.serve_flags.cache import (
    BLOCK_SIZE,
    ENABLE_PREFIX_CACHING,
    GPU_MEMORY_UTILIZATION,
    KV_CACHE_DTYPE,
    KV_OFFLOADING_BACKEND,
    KV_OFFLOADING_SIZE,
    NUM_GPU_BLOCKS_OVERRIDE,
    PREFIX_CACHING_HASH_ALGO,
)

_CACHE = [
    declared(BLOCK_SIZE, ONE, "scheduler and worker"),
    refused("--enable-mamba-shared-prefix-checkpoint", BOOL, why.MAMBA, accepts=(False,)),
    declared(ENABLE_PREFIX_CACHING, BOOL, "scheduler"),
    declared(GPU_MEMORY_UTILIZATION, ONE, "worker, on CUDA (default 0.9, the worker's; vLLM 0.32's is 0.92)"),
    declared(KV_CACHE_DTYPE, ONE, "worker and scheduler: the KV tensors' dtype"),
    refused("--kv-cache-dtype-skip-layers", MANY, "one KV cache dtype for every layer: keeping some layers out of the fp8 cache is not supported yet"),
    handled("--kv-cache-memory-bytes", ONE, "worker (its --kv-cache-memory)", type=human_readable_int, default=None, metavar="BYTES",
            help="the KV cache's size in bytes (4G, 8000M...), instead of --gpu-memory-utilization's share"),
    declared(KV_OFFLOADING_BACKEND, ONE, "scheduler and worker: native (the host tier), disk or mooncake (an external tier below it)"),
    declared(KV_OFFLOADING_SIZE, ONE, "scheduler and worker"),
    refused("--kv-sharing-fast-prefill", BOOL, why.NOT_YET, accepts=(False,)),
    refused("--mamba-block-size", ONE, why.MAMBA),
    refused("--mamba-cache-dtype", ONE, why.MAMBA, accepts=("auto",)),
    refused("--mamba-cache-mode", ONE, why.MAMBA, accepts=("none",)),
    refused("--mamba-ssm-cache-dtype", ONE, why.MAMBA, accepts=("auto",)),
    declared(NUM_GPU_BLOCKS_OVERRIDE, ONE, "scheduler and worker: the worker allocates exactly N blocks"),
    refused("--prefix-cache-retention-interval", ONE, why.NOT_YET, accepts=("0",)),
    declared(PREFIX_CACHING_HASH_ALGO, ONE, "scheduler"),
    passed("--prefix-match-unit", ONE, "scheduler"),
    refused("--replayssm-buffer-len", ONE, why.MAMBA),
    refused("--swa-bounded-replay", BOOL, why.MAMBA, accepts=(True,)),
    refused("--use-replayssm", BOOL, why.MAMBA, accepts=(False,)),
]

_OFFLOAD = [
    refused("--cpu-offload-gb", ONE, why.WEIGHT_OFFLOAD, accepts=("0",)),
    refused("--cpu-offload-params", MANY, why.WEIGHT_OFFLOAD),
    refused("--offload-backend", ONE, why.WEIGHT_OFFLOAD, accepts=("auto",)),
    refused("--offload-group-size", ONE, why.WEIGHT_OFFLOAD, accepts=("0",)),
    refused("--offload-num-in-group", ONE, why.WEIGHT_OFFLOAD, accepts=("1",)),
    refused("--offload-params", MANY, why.WEIGHT_OFFLOAD),
    refused("--offload-prefetch-step", ONE, why.WEIGHT_OFFLOAD, accepts=("1",)),
]

GROUPS = [
    Group("CacheConfig", "Configuration for the KV cache.", _CACHE),
    Group("OffloadConfig", "Configuration for model weight offloading to reduce GPU memory usage.", _OFFLOAD),
]
