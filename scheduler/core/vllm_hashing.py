"""vLLM 0.32's block hashes, exactly: for an indexer that hashes tokens itself (llm-d's
kv-cache-manager, a router's own index) and must find the blocks a KV event names.

vLLM (vllm/v1/core/kv_cache_utils.py, vllm/utils/hashing.py):

* hash(block) = H((parent_block_hash, tuple(block token ids), extra_keys)), the parent
  of the first block being ``NONE_HASH = H(seed)``;
* H serialises its argument with pickle (highest protocol: ``sha256``, ``xxhash``) or
  canonical CBOR (``sha256_cbor``, ``xxhash_cbor``), then takes SHA-256 or xxh3-128;
* the seed is ``PYTHONHASHSEED`` when set; else the fixed ``"vllm-none-hash"`` for
  the SHA-256 ones and fresh random bytes for the xxhash ones (their seed must stay
  secret: a known seed lets a client craft colliding blocks);
* extra keys: ``None``, or a tuple of tagged keys; kvpool's only one is
  ``("cache_salt", salt)``, on the first block (LoRA and multimodal keys do not arise:
  kvpool refuses both).

A KV event carries the low 64 bits of the hash (protocol.kv_events.int_block_hash),
computed from these bytes as from kvpool's own.

NOTE: pickle's bytes for a tuple of bytes, ints and None are the same in every
CPython 3 at the same protocol, so these hashes agree with a vLLM process on another
host; ``pickle.HIGHEST_PROTOCOL`` is 5 from Python 3.8 on.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import sys
from collections.abc import Callable, Sequence
from typing import Any

from scheduler.core.kv_cache_block import BlockHash

VLLM_HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
# vLLM's DEFAULT_NONE_HASH_SEED: the seed of the collision-resistant algorithms without PYTHONHASHSEED.
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
_NON_CRYPTO = ("xxhash", "xxhash_cbor")
# The algorithms whose chains vLLM seeds at random without PYTHONHASHSEED (their hashes differ per process).
RANDOMLY_SEEDED_ALGOS = _NON_CRYPTO


def _pickled(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _cbor(obj: Any) -> bytes:
    import cbor2

    return cbor2.dumps(obj, canonical=True)


def vllm_hash_function(algo: str) -> Callable[[Any], bytes]:
    """vLLM's get_hash_fn_by_name: the function from any object to its hash bytes."""
    if algo not in VLLM_HASH_ALGOS:
        raise ValueError(f"unknown vLLM prefix-caching hash algorithm {algo!r}; choose one of {', '.join(VLLM_HASH_ALGOS)}")
    serialise = _cbor if algo.endswith("_cbor") else _pickled
    if algo.startswith("sha256"):
        return lambda obj: hashlib.sha256(serialise(obj)).digest()
    import xxhash

    return lambda obj: xxhash.xxh3_128_digest(serialise(obj))


def resolve_none_hash_seed(algo: str, python_hash_seed: str | None) -> str:
    """vLLM's resolve_none_hash_seed, given the value of PYTHONHASHSEED (None: unset)."""
    if python_hash_seed is not None:
        return python_hash_seed
    if algo in _NON_CRYPTO:
        return os.urandom(32).hex()
    return DEFAULT_NONE_HASH_SEED


class VllmBlockHasher:
    """BlockHasher's interface (scheduler/core/hashing.py) with vLLM's hash functions."""

    def __init__(self, block_size: int, algo: str = "sha256", python_hash_seed: str | None = None):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.algo = algo
        self._hash = vllm_hash_function(algo)
        self.none_hash_seed = resolve_none_hash_seed(algo, python_hash_seed)
        self.none_hash: BlockHash = self._hash(self.none_hash_seed)

    def hash_block_tokens(self, parent_block_hash: BlockHash | None, block_token_ids: Sequence[int],
                          extra_keys: tuple | None = None) -> BlockHash:
        """vLLM's hash_block_tokens: the hash of one full block given its parent's (None: the first)."""
        parent = parent_block_hash or self.none_hash
        return self._hash((parent, tuple(block_token_ids), extra_keys))

    def extend_block_hashes(self, block_hashes: list[BlockHash], token_ids: Sequence[int], cache_salt: str | None = None) -> None:
        """Append the hash of every full block of ``token_ids`` not hashed yet (incremental)."""
        bs = self.block_size
        parent = block_hashes[-1] if block_hashes else self.none_hash
        for i in range(len(block_hashes), len(token_ids) // bs):
            extra = (("cache_salt", cache_salt),) if i == 0 and cache_salt else None
            parent = self._hash((parent, tuple(token_ids[i * bs : (i + 1) * bs]), extra))
            block_hashes.append(parent)

    def chain_packed_blocks(self, parent_block_hash: BlockHash | None, packed_token_ids: bytes) -> list[BlockHash]:
        """As BlockHasher's: blocks given as packed little-endian uint32 token ids, no salt."""
        step = 4 * self.block_size
        if len(packed_token_ids) % step:
            raise ValueError(f"{len(packed_token_ids)} bytes is not a whole number of {self.block_size}-token blocks")
        tokens = memoryview(packed_token_ids).cast("I").tolist() if sys.byteorder == "little" else [
            int.from_bytes(packed_token_ids[i : i + 4], "little") for i in range(0, len(packed_token_ids), 4)]
        parent = parent_block_hash or self.none_hash
        out: list[BlockHash] = []
        for i in range(0, len(tokens), self.block_size):
            parent = self._hash((parent, tuple(tokens[i : i + self.block_size]), None))
            out.append(parent)
        return out

    def block_hashes(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[BlockHash]:
        out: list[BlockHash] = []
        self.extend_block_hashes(out, token_ids, cache_salt)
        return out


# kvpool's own hashes (scheduler/core/hashing.py: SHA-256 or xxh3-128 over packed uint32
# tokens, its own seed), by the names the scheduler and `kvpool serve` take for them.
KVPOOL_HASH_ALGOS = {"kvpool_sha256": "sha256", "kvpool_xxhash": "xxhash"}
# Every --prefix-caching-hash-algo: kvpool's own (the default, the fastest), then vLLM's.
PREFIX_CACHING_HASH_ALGOS = (*KVPOOL_HASH_ALGOS, *VLLM_HASH_ALGOS)
DEFAULT_PREFIX_CACHING_HASH_ALGO = "kvpool_sha256"


def make_block_hasher(block_size: int, name: str, python_hash_seed: str | None = None):
    """The hasher ``--prefix-caching-hash-algo name`` selects: kvpool's own (BlockHasher)
    or vLLM's exact one (VllmBlockHasher, seeded as vLLM from ``python_hash_seed``)."""
    from scheduler.core.hashing import BlockHasher

    if name in KVPOOL_HASH_ALGOS:
        return BlockHasher(block_size, KVPOOL_HASH_ALGOS[name])
    if name in VLLM_HASH_ALGOS:
        return VllmBlockHasher(block_size, name, python_hash_seed)
    raise ValueError(f"unknown prefix-caching hash algorithm {name!r}; choose one of {', '.join(PREFIX_CACHING_HASH_ALGOS)}")
