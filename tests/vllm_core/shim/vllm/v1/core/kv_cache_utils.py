"""vLLM's kv_cache_utils: kvpool's block, free queue and vLLM-exact hashing.

A (hash, group) key is kvpool's: the hash with the group id as 4 big-endian bytes
appended (single_type_kv_cache_manager.group_key), vLLM's BlockHashWithGroupId.
"""

from __future__ import annotations

import os

from protocol.kv_events import int_block_hash, int_block_hashes_from_env
from scheduler.core.free_block_queue import FreeKVCacheBlockQueue
from scheduler.core.kv_cache_block import KVCacheBlock
from scheduler.core.single_type_kv_cache_manager import group_key
from scheduler.core.vllm_hashing import DEFAULT_NONE_HASH_SEED, VllmBlockHasher
from scheduler.core.vllm_hashing import resolve_none_hash_seed as kvpool_resolve_none_hash_seed
from vllm.unmapped import module_getattr, refuse
from vllm.utils.hashing import ALGO

__all__ = ["DEFAULT_NONE_HASH_SEED", "FreeKVCacheBlockQueue", "KVCacheBlock"]
__getattr__ = module_getattr(__name__)

BlockHash = bytes
BlockHashWithGroupId = bytes
NONE_HASH: bytes = b""
NONE_HASH_SEED: str | None = None


def make_block_hash_with_group_id(block_hash: bytes, group_id: int) -> bytes:
    return block_hash + group_key(group_id)


def is_bare(key: bytes) -> bool:
    """A key of kvpool's one-group pool: the bare hash (as long as NONE_HASH), group 0's."""
    return len(key) == len(NONE_HASH)


def get_block_hash(key: bytes) -> bytes:
    return key if is_bare(key) else key[:-4]


def get_group_id(key: bytes) -> int:
    return 0 if is_bare(key) else int.from_bytes(key[-4:], "big")


def maybe_convert_block_hash(block_hash: bytes):
    """A hash as KV events send it: its low 64 bits, unless VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0."""
    return int_block_hash(block_hash) if int_block_hashes_from_env(os.environ) else block_hash


def algo_of(hash_fn) -> str:
    if hash_fn not in ALGO:
        refuse(f"hash function {hash_fn!r}")
    return ALGO[hash_fn]


def resolve_none_hash_seed(hash_fn) -> str:
    return kvpool_resolve_none_hash_seed(algo_of(hash_fn), os.environ.get("PYTHONHASHSEED"))


def init_none_hash(hash_fn) -> None:
    global NONE_HASH, NONE_HASH_SEED
    NONE_HASH_SEED = resolve_none_hash_seed(hash_fn)
    NONE_HASH = hash_fn(NONE_HASH_SEED)


def get_none_hash_seed() -> str:
    return DEFAULT_NONE_HASH_SEED if NONE_HASH_SEED is None else NONE_HASH_SEED


def hasher(block_size: int, hash_fn) -> VllmBlockHasher:
    """kvpool's vLLM-exact hasher, chained from this module's NONE_HASH."""
    h = VllmBlockHasher(block_size, algo_of(hash_fn), get_none_hash_seed())
    h.none_hash = NONE_HASH
    return h


def hash_block_tokens(hash_fn, parent_block_hash, curr_block_token_ids, extra_keys=None) -> bytes:
    return hasher(max(len(curr_block_token_ids), 1), hash_fn).hash_block_tokens(
        parent_block_hash, curr_block_token_ids, extra_keys)


def get_request_block_hasher(hash_block_size: int, caching_hash_fn):
    """vLLM's request block hasher: the hashes of the request's full blocks not hashed yet."""

    def request_block_hasher(request) -> list[bytes]:
        if request.mm_features or request.lora_request is not None or request.prompt_embeds is not None:
            refuse("multimodal, LoRA or prompt-embeds block hashes (kvpool refuses those requests)")
        hashes = list(request.block_hashes)
        num_hashed = len(hashes)
        hasher(hash_block_size, caching_hash_fn).extend_block_hashes(hashes, request.all_token_ids, request.cache_salt)
        return hashes[num_hashed:]

    return request_block_hasher
