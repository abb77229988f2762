"""The settings table's rows of vLLM's CacheConfig: the KV cache's blocks, their dtype,
the prefix cache and the tiers below the device."""

from __future__ import annotations

import argparse

from protocol.kv_cache_spec import DEFAULT_BLOCK_SIZE, KV_CACHE_DTYPES
from protocol.serve_flags.flag import SCHEDULER, WORKER, flag
from protocol.serve_flags.values import VLLM_CACHE_DTYPES, fraction, gib

BLOCK_SIZE = flag("--block-size", SCHEDULER, WORKER, type=int, default=DEFAULT_BLOCK_SIZE,
                  help="tokens per KV block (default %(default)s)")
KV_CACHE_DTYPE = flag("--kv-cache-dtype", SCHEDULER, WORKER, default="auto", choices=VLLM_CACHE_DTYPES, accepts=KV_CACHE_DTYPES,
                      why_not="kvpool's KV cache is the model's dtype (auto; choose it with --dtype) or fp8 (fp8, fp8_e4m3, "
                              "fp8_e5m2), the ones vLLM's CPU attention supports; other cache dtypes are not supported yet",
                      help="auto: the model's dtype (--dtype); fp8 (= fp8_e4m3) or fp8_e5m2: one byte per element, twice "
                           "the blocks, per-tensor scales as vLLM's (default %(default)s)")
NUM_GPU_BLOCKS_OVERRIDE = flag("--num-gpu-blocks-override", SCHEDULER, WORKER, type=int, default=None, metavar="N",
                               help="a KV cache of exactly N blocks, whatever the memory budget holds, as vLLM; refused "
                                    "when the device cannot hold them (default: what the budget holds)")
GPU_MEMORY_UTILIZATION = flag("--gpu-memory-utilization --device-memory-utilization", WORKER, type=fraction, default=0.9,
                              help="on CUDA without a KV size: the share of device memory the worker may use, weights and "
                                   "the profiled activation peak included (default %(default)s; vLLM's 0.92)")
ENABLE_PREFIX_CACHING = flag("--enable-prefix-caching", SCHEDULER, action=argparse.BooleanOptionalAction, default=True,
                             help="reuse the KV blocks of a cached prefix (default: on, as vLLM)")
KV_OFFLOADING_SIZE = flag("--kv-offloading-size", SCHEDULER, WORKER, type=gib, default=0.0, metavar="GIB",
                          help="GiB of host memory for evicted KV blocks, loaded back on a prefix hit; the worker "
                               "allocates it (pinned on CUDA), the scheduler's tier takes the slots (default: off)")
KV_OFFLOADING_BACKEND = flag("--kv-offloading-backend", SCHEDULER, WORKER, default="native",
                             accepts=("native", "disk", "mooncake"),
                             why_not="LMCache is not supported; kvpool's tiers are its host tier (native) and its disk "
                                     "or mooncake tiers",
                             help="native: the host tier (with --kv-offloading-size); disk (--kv-offloading-path, "
                                  "--kv-offloading-disk-size) or mooncake (--mooncake-master, --mooncake-metadata): also "
                                  "a tier every computed block is saved to and loaded back from, kept across restarts "
                                  "and (mooncake) shared by replicas (default %(default)s)")

# NOTE: the scheduler's hashes (scheduler/core/vllm_hashing.py PREFIX_CACHING_HASH_ALGOS, checked
# equal by tests/scheduler/engine/test_settings_rows.py): kvpool's own over packed tokens, then vLLM's four.
PREFIX_CACHING_HASH_ALGO = flag("--prefix-caching-hash-algo", SCHEDULER, default="kvpool_sha256",
                                choices=("kvpool_sha256", "kvpool_xxhash", "sha256", "sha256_cbor", "xxhash", "xxhash_cbor"),
                                help="the prefix cache's block hash: kvpool_sha256 (default) or kvpool_xxhash, kvpool's own "
                                     "over packed tokens; or vLLM's sha256, sha256_cbor, xxhash, xxhash_cbor, exactly "
                                     "(seeded from PYTHONHASHSEED as vLLM), for an indexer that hashes tokens itself")

ROWS = (BLOCK_SIZE, KV_CACHE_DTYPE, NUM_GPU_BLOCKS_OVERRIDE, GPU_MEMORY_UTILIZATION, ENABLE_PREFIX_CACHING,
        PREFIX_CACHING_HASH_ALGO, KV_OFFLOADING_SIZE, KV_OFFLOADING_BACKEND)
