"""``vllm serve``'s CacheConfig and OffloadConfig groups: the KV cache, its prefix cache
and the host-memory tier."""

from __future__ import annotations

import argparse

from frontend.serve.flags import reasons as why
from frontend.serve.flags.rules import BOOL, MANY, ONE, Group, handled, passed, refused
from frontend.serve.flags.values import human_readable_int
from protocol.kv_cache_spec import DEFAULT_BLOCK_SIZE, KV_CACHE_DTYPES

# --prefix-caching-hash-algo: kvpool's own hashes over packed tokens (the default), then
# vLLM's four, each exactly as vLLM 0.32 (scheduler/core/vllm_hashing.py).
HASH_ALGOS = ("kvpool_sha256", "kvpool_xxhash", "sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
# vLLM 0.32's CacheDType: argparse's choices, as vLLM's; kvpool accepts KV_CACHE_DTYPES of them.
VLLM_CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla", "nvfp4_ds_mla",
                     "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc", "ultraquant_4bit",
                     "int4_per_token_head", "int8_per_token_head", "fp8_per_token_head", "nvfp4", "nvfp4_4over6")

_CACHE = [
    handled("--block-size", ONE, "scheduler and worker", type=int, default=DEFAULT_BLOCK_SIZE, help="tokens per KV block (default %(default)s)"),
    refused("--enable-mamba-shared-prefix-checkpoint", BOOL, why.MAMBA, accepts=(False,)),
    handled("--enable-prefix-caching", BOOL, "scheduler", action=argparse.BooleanOptionalAction, default=True,
            help="reuse the KV blocks of a cached prefix (default: on, as vLLM)"),
    handled("--gpu-memory-utilization --device-memory-utilization", ONE, "worker, on CUDA (default 0.9, the worker's; vLLM 0.32's is 0.92)",
            type=float, default=0.9,
            help="on CUDA without a KV size: the share of device memory the worker may use (default %(default)s; vLLM's 0.92)"),
    handled("--kv-cache-dtype", ONE, "worker and scheduler: the KV tensors' dtype", default="auto", choices=VLLM_CACHE_DTYPES,
            accepts=KV_CACHE_DTYPES, why_not=why.KV_DTYPE,
            help="auto: the model's dtype (--dtype); fp8 (= fp8_e4m3) or fp8_e5m2: one byte per element, twice the blocks, "
                 "per-tensor scales as vLLM's (default %(default)s)"),
    refused("--kv-cache-dtype-skip-layers", MANY, "one KV cache dtype for every layer: keeping some layers out of the fp8 cache is not supported yet"),
    handled("--kv-cache-memory-bytes", ONE, "worker (its --kv-cache-memory)", type=human_readable_int, default=None, metavar="BYTES",
            help="the KV cache's size in bytes (4G, 8000M...), instead of --gpu-memory-utilization's share"),
    handled("--kv-offloading-backend", ONE, "scheduler and worker: native (the host tier), disk or mooncake (an external tier below it)",
            default=None, accepts=(None, "native", "disk", "mooncake"),
            why_not="LMCache is not supported; kvpool's tiers are its host tier (native) and its disk or mooncake tiers",
            help="native: the host tier (with --kv-offloading-size); disk (--kv-offloading-path, --kv-offloading-disk-size) or "
                 "mooncake (--mooncake-master, --mooncake-metadata): also a tier every computed block is saved to and "
                 "loaded back from, kept across restarts and (mooncake) shared by replicas"),
    handled("--kv-offloading-size", ONE, "scheduler and worker", type=float, default=0.0, metavar="GIB",
            help="GiB of host memory for evicted KV blocks, loaded back on a prefix hit (default: off)"),
    refused("--kv-sharing-fast-prefill", BOOL, why.NOT_YET, accepts=(False,)),
    refused("--mamba-block-size", ONE, why.MAMBA),
    refused("--mamba-cache-dtype", ONE, why.MAMBA, accepts=("auto",)),
    refused("--mamba-cache-mode", ONE, why.MAMBA, accepts=("none",)),
    refused("--mamba-ssm-cache-dtype", ONE, why.MAMBA, accepts=("auto",)),
    handled("--num-gpu-blocks-override", ONE, "scheduler and worker: the worker allocates exactly N blocks", type=int, default=None,
            metavar="N", help="a KV cache of exactly N blocks, whatever --kv-cache-memory holds, as vLLM; refused when the "
                              "device cannot hold them"),
    refused("--prefix-cache-retention-interval", ONE, why.NOT_YET, accepts=("0",)),
    handled("--prefix-caching-hash-algo", ONE, "scheduler", default=None, choices=HASH_ALGOS,
            help="the prefix cache's block hash: kvpool_sha256 (default) or kvpool_xxhash, kvpool's own over packed "
                 "tokens; or vLLM's sha256, sha256_cbor, xxhash, xxhash_cbor, exactly (seeded from PYTHONHASHSEED as "
                 "vLLM), for an indexer that hashes tokens itself"),
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
