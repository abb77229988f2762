"""KVCacheBlock: the engine core's whole idea of one physical KV block."""

from __future__ import annotations

# A block hash is any bytes value (SHA-256 digest by default, see scheduler/core/hashing.py).
BlockHash = bytes


class KVCacheBlock:
    """One block of KV memory, known to the scheduler only by its id.

    Made once at start-up (a fixed list, so a block id is also an index) and then
    only moved between the free queue, request block tables and the hash map.

    ref_cnt == 0: in the free queue (may still hold a valid, hashed block);
    ref_cnt == 1: owned by one request; ref_cnt >= 2: a shared prefix, read-only.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block", "is_null")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        # None until the block is full and cached; set at scheduling time.
        self.block_hash: BlockHash | None = None
        # Links of the free queue; both None while the block is in use.
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        # The null block (block 0) is a placeholder: never handed out, never freed.
        self.is_null = False

    # vLLM's names for the two writes of the hash. NOTE: the pool's own hot paths
    # write ``block_hash`` directly: the slot stays a plain attribute, read at no cost.
    def set_block_hash(self, block_hash: BlockHash) -> None:
        assert self.block_hash is None, "The block already has a hash. This should not happen."
        self.block_hash = block_hash

    def reset_hash(self) -> None:
        """Drop the hash (the block is evicted)."""
        self.block_hash = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h})"
