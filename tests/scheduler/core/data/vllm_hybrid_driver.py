"""Drives vLLM 0.32's own KVCacheManager over a hybrid KVCacheConfig (one group per
window, 0 full attention; one block size; caching on or off; sliding groups' sparse
retention at ``vllm serve``'s default, ``prefix_cache_retention_interval=0``, each
request's ``shared_prefix_boundary`` set from its lookup as vLLM's scheduler sets it)
through the operations of
tests/scheduler/core/hybrid/test_hybrid_vs_vllm.py, and prints its state after each one.
Run with the vLLM venv: ``.venv-vllm/bin/python THIS < cases.json``.

The operations (each case: num_blocks, block_size, max_model_len,
max_num_batched_tokens, windows, ops), as a synchronous scheduler makes them:
  ["admit", rid, tokens, chunk, full_must_fit]: lookup, then allocate_slots for at most
      ``chunk`` tokens past the hit (a new request, or one preempted earlier);
  ["step", rid, n, token]: a running request's next n tokens (a decode first appends ``token``);
  ["free", rid]; ["preempt", rid]: freed, computed tokens back to 0, to be admitted again.
"""

import json
import sys

import torch
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request, RequestStatus


def spec(window: int, block_size: int):
    kw = {"block_size": block_size, "num_kv_heads": 1, "head_size": 8, "dtype": torch.float32}
    return (
        FullAttentionSpec(**kw) if window == 0 else SlidingWindowSpec(**kw, sliding_window=window)
    )


def run(case: dict) -> list[dict]:
    bs = case["block_size"]
    hash_fn = get_hash_fn_by_name(
        "sha256"
    )  # NOTE: PYTHONHASHSEED unset: vLLM's fixed NONE_HASH seed
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(bs, hash_fn)
    groups = [KVCacheGroupSpec([f"layer.{g}"], spec(w, bs)) for g, w in enumerate(case["windows"])]
    kv = KVCacheManager(
        # NOTE: CacheConfig.prefix_cache_retention_interval defaults to 0 (KVCacheConfig's to None: dense).
        KVCacheConfig(
            num_blocks=case["num_blocks"],
            kv_cache_tensors=[],
            kv_cache_groups=groups,
            prefix_cache_retention_interval=0,
        ),
        max_model_len=case["max_model_len"],
        scheduler_block_size=bs,
        hash_block_size=bs,
        max_in_flight_tokens=case["max_num_batched_tokens"],
        enable_caching=case["enable_caching"],
        log_stats=True,
        enable_kv_cache_events=True,
    )
    requests: dict[str, Request] = {}
    running: set[str] = set()
    out = []
    for op in case["ops"]:
        kind, rid = op[0], op[1]
        result = None
        if (kind == "admit") == (rid in running):
            result = "skip"  # an op on a request the generator only guessed was (not) running
        elif kind == "admit":
            tokens, chunk, full_must_fit = op[2], op[3], op[4]
            r = requests.get(rid)
            if r is None:
                r = Request(rid, tokens, SamplingParams(max_tokens=64), None, block_hasher=hasher)
            # As Scheduler.schedule: the lookup (at 0 computed tokens) sets the junction.
            blocks, n, r.shared_prefix_boundary = kv.get_computed_blocks(r)
            num_new = min(chunk, r.num_tokens - n)
            new = kv.allocate_slots(r, num_new, n, blocks, full_sequence_must_fit=full_must_fit)
            if new is not None:
                kv.record_prefix_cache_stats(r, n)
                r.num_computed_tokens = n + num_new
                r.status = RequestStatus.RUNNING
                requests[rid] = r
                running.add(rid)
            result = [n, None if new is None else [list(g) for g in new.get_block_ids()]]
        elif kind == "step":
            r = requests[rid]
            if r.num_computed_tokens == r.num_tokens:
                r.append_output_token_ids(op[3])
            num_new = min(op[2], r.num_tokens - r.num_computed_tokens)
            new = kv.allocate_slots(r, num_new)
            if new is not None:
                r.num_computed_tokens += num_new
            result = None if new is None else [list(g) for g in new.get_block_ids()]
        elif kind == "free":
            running.discard(rid)
            kv.free(requests.pop(rid))
        elif kind == "preempt":
            running.discard(rid)
            r = requests[rid]
            kv.free(r)
            r.num_computed_tokens = 0
            r.status = RequestStatus.PREEMPTED
            r.num_preemptions += 1
        stats = kv.prefix_cache_stats
        stored, removed = [], []
        for event in kv.take_events():
            if isinstance(event, BlockStored):
                kind, window = event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window
                stored += [[h.hex(), event.group_idx, kind, window] for h in event.block_hashes]
            elif isinstance(event, BlockRemoved):
                removed += [[h.hex(), event.group_idx] for h in event.block_hashes]
        out.append({
            "result": result,
            "tables": {k: [list(g) for g in kv.get_block_ids(k)] for k in sorted(requests)},
            "free": kv.block_pool.get_num_free_blocks(),
            "usage": kv.usage,
            "queries": stats.queries,
            "hits": stats.hits,
            "preempted_queries": stats.preempted_queries,
            "preempted_hits": stats.preempted_hits,
            # (hash, group) keys of the prefix cache, and this operation's KV events.
            "keys": sorted(k.hex() for k in kv.block_pool.cached_block_hash_to_block._cache),
            "stored": stored,
            "removed": removed,
        })
    return out


print(json.dumps([run(case) for case in json.load(sys.stdin)]))
