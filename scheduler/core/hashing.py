"""Prefix-cache block hashes: chained per full block.

hash(block i) = H(hash(block i-1) || packed token ids of block i || extra keys)

* The first block's parent is a fixed seed (``NONE_HASH``), so hashes agree across
  processes and restarts (a KV-event consumer can rely on them).
* Token ids are packed as little-endian uint32, not pickled: fast, and the same
  bytes everywhere.
* Extra keys: ``cache_salt``, first block only. Different salts give different
  chains, so tenants with different salts never share a block.
* The parent hash and the packed tokens have fixed lengths, so whatever follows
  them (the salt) cannot be confused with tokens.

``sha256`` (default) is collision-resistant. ``xxhash`` (xxh3-128) is about twice
as fast and not cryptographic: a crafted collision could make one tenant read
another's KV, so use it only where every client is trusted.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from typing import Any

from scheduler.core.kv_cache_block import BlockHash

HASH_ALGOS = ("sha256", "xxhash")

# The parent of every first block. Fixed: hashes must agree across restarts.
NONE_HASH: BlockHash = hashlib.sha256(b"kvpool/block-hash-seed/v1").digest()


def _salt_key(cache_salt: str | None) -> bytes:
    return b"" if not cache_salt else b"salt:" + cache_salt.encode("utf-8")


class BlockHasher:
    """Hashes the full blocks of a token sequence, for one block size and algorithm."""

    def __init__(self, block_size: int, algo: str = "sha256"):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if algo not in HASH_ALGOS:
            raise ValueError(f"unknown prefix-caching hash algorithm {algo!r}; choose one of {', '.join(HASH_ALGOS)}")
        self.block_size = block_size
        self.algo = algo
        self._pack = struct.Struct(f"<{block_size}I").pack
        # A hash object from its data: ``self._new(data).digest()`` is the hash.
        # NOTE: called directly, not wrapped in a function: a Python frame per
        # block costs about a tenth of a decode block's hashing.
        self._new: Callable[[bytes], Any]
        if algo == "sha256":
            self._new = hashlib.sha256
        else:
            import xxhash

            self._new = xxhash.xxh3_128

    def hash_block_tokens(self, parent_block_hash: BlockHash, block_token_ids: Sequence[int], extra_keys: bytes = b"") -> BlockHash:
        """The hash of one full block given its parent's hash."""
        return self._new(parent_block_hash + self._pack(*block_token_ids) + extra_keys).digest()

    def extend_block_hashes(
        self, block_hashes: list[BlockHash], token_ids: Sequence[int], cache_salt: str | None = None
    ) -> None:
        """Append to ``block_hashes`` the hash of every full block of ``token_ids``
        that it does not have yet (incremental: call after tokens are appended)."""
        bs = self.block_size
        num_full = len(token_ids) // bs
        start = len(block_hashes)
        if start >= num_full:
            return
        pack, new = self._pack, self._new
        if num_full == start + 1 and start:
            # NOTE: the decode case, one block more past the (salted) first: no loop.
            block_hashes.append(new(block_hashes[-1] + pack(*token_ids[start * bs : num_full * bs])).digest())
            return
        parent = block_hashes[-1] if start else NONE_HASH
        for i in range(start, num_full):
            data = parent + pack(*token_ids[i * bs : (i + 1) * bs])
            if i == 0 and cache_salt:
                data += _salt_key(cache_salt)
            parent = new(data).digest()
            block_hashes.append(parent)

    def chain_packed_blocks(self, parent_block_hash: BlockHash, packed_token_ids: bytes) -> list[BlockHash]:
        """The hashes of consecutive full blocks given as packed little-endian uint32
        token ids (``numpy.ndarray.astype('<u4').tobytes()``), chained from
        ``parent_block_hash``, no salt: what extend_block_hashes gives for the same
        blocks, without a pack call per block."""
        step = 4 * self.block_size
        if len(packed_token_ids) % step:
            raise ValueError(f"{len(packed_token_ids)} bytes is not a whole number of {self.block_size}-token blocks")
        new = self._new
        parent = parent_block_hash
        out: list[BlockHash] = []
        for i in range(0, len(packed_token_ids), step):
            parent = new(parent + packed_token_ids[i : i + step]).digest()
            out.append(parent)
        return out

    def block_hashes(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[BlockHash]:
        out: list[BlockHash] = []
        self.extend_block_hashes(out, token_ids, cache_salt)
        return out
