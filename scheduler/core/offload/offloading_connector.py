"""OffloadingConnector: the KV cache manager's side of the host tier.

The role of vLLM's OffloadingConnectorScheduler: it decides which device blocks
go to the host tier (`scheduler/core/offload/offload_tier.py`, vLLM's
--kv-offloading-size) and when, checks the host hits an admission claims, gives
them their device blocks as loads, and hands each step's copies to the plan.

Blocks go to the tier when their hash leaves its last device block
(``offload_store="eviction"``, lazy eviction in get_new_blocks: the store is in
the plan of the step that reuses the block, and stores run first) or once they
are computed (``"full"``, write-through: stored in the plan after the one that
computes them). `take_copies` gives a step's copies, `complete_copies` completes
them once the step's result is in.
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.core.block_pool import BlockPool
from scheduler.core.kv_cache_block import BlockHash, KVCacheBlock
from scheduler.core.kv_cache_request import KVCacheRequest
from scheduler.core.offload.offload_tier import HostBlock, HostTier, HostTierCopies


class OffloadingConnector:
    """The host tier ``host_tier`` under the device pool ``block_pool``; stores
    on eviction, or write-through when ``write_through``."""

    def __init__(self, host_tier: HostTier, block_pool: BlockPool, write_through: bool):
        self.host_tier = host_tier
        self.block_pool = block_pool
        self.block_size = host_tier.block_size
        self.write_through = write_through
        # Write-through: (device block id, hash) cached by the step being scheduled,
        # and by the step before (computed by its plan, stored in this one's).
        self._written_this_step: list[tuple[int, BlockHash]] = []
        self._written_last_step: list[tuple[int, BlockHash]] = []
        if not write_through:
            block_pool.evicted = []

    # --- loads ------------------------------------------------------------------------

    def lookup(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many of ``block_hashes``, from the first, the tier holds."""
        return self.host_tier.lookup(block_hashes)

    def held(self, block_hashes: Sequence[BlockHash]) -> list[bool]:
        """For each hash, whether the tier holds it."""
        return self.host_tier.held(block_hashes)

    def get_num_hits(self, request: KVCacheRequest, num_held: int, num_new_computed_tokens: int, num_device_hits: int) -> int:
        """The number of host-tier hit blocks in an admission's computed tokens (those
        past its ``num_device_hits`` device hits; it holds ``num_held`` blocks), or
        ValueError if they are not what get_computed_blocks found."""
        if num_held or request.num_computed_tokens:
            raise ValueError(f"request {request.request_id!r} already holds blocks; prefix hits only at admission")
        if num_new_computed_tokens % self.block_size:
            raise ValueError(f"num_new_computed_tokens {num_new_computed_tokens} is not a multiple of the block size {self.block_size}")
        num_host_hits = num_new_computed_tokens // self.block_size - num_device_hits
        hashes = request.block_hashes[num_device_hits : num_device_hits + num_host_hits]
        if len(hashes) != num_host_hits or self.host_tier.lookup(hashes) != num_host_hits:
            raise ValueError(f"request {request.request_id!r}: {num_host_hits} host-tier hits claimed, the tier holds fewer")
        return num_host_hits

    def pin_hits(self, block_hashes: Sequence[BlockHash]) -> list[HostBlock]:
        """Protect the host entries an admission will load from eviction, before its
        device blocks are allocated (their evictions may need host slots)."""
        return self.host_tier.pin(block_hashes)

    def add_loads(self, entries: Sequence[HostBlock], new_blocks: Sequence[KVCacheBlock]) -> None:
        """Load each pinned entry into the new device block beside it, in this step's plan."""
        self.host_tier.add_loads(entries, [b.block_id for b in new_blocks])

    # --- stores -----------------------------------------------------------------------

    def store_evicted(self) -> None:
        """Eviction mode: every hash that just left its last device block goes to
        the host tier, from the block now being reused (the store runs first)."""
        evicted = self.block_pool.evicted
        self.host_tier.prepare_stores(evicted)
        evicted.clear()

    def add_written(self, req_blocks: list[KVCacheBlock], block_hashes: Sequence[BlockHash], start: int, end: int) -> None:
        """Write-through: blocks ``start`` .. ``end - 1`` of a table were just cached;
        they are stored in the plan after this one (which computes them)."""
        self._written_this_step.extend((req_blocks[i].block_id, block_hashes[i]) for i in range(start, end))

    def forget_written(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Write-through: these blocks, cached in the step being planned, will not be
        computed by it after all (their request was preempted): no store."""
        block_ids = {b.block_id for b in blocks}
        self._written_this_step = [w for w in self._written_this_step if w[0] not in block_ids]

    # --- the step's copies ------------------------------------------------------------

    def take_copies(self) -> HostTierCopies | None:
        """The copies of the step being planned (None: none), in flight until
        `complete_copies`. Call once per plan, after every allocation of the step."""
        if self._written_last_step:
            # Write-through: blocks computed by the previous plan.
            self.host_tier.prepare_stores(self._written_last_step)
        self._written_last_step, self._written_this_step = self._written_this_step, []
        return self.host_tier.take_copies()

    def complete_copies(self) -> None:
        """The plan in flight ran: its copies are done."""
        self.host_tier.complete_copies()

    def clear(self) -> None:
        """Forget the tier's contents and every copy not yet made (a prefix-cache reset)."""
        self.host_tier.clear()
        self._written_this_step.clear()
        self._written_last_step.clear()
        if self.block_pool.evicted:
            self.block_pool.evicted.clear()

    def check_invariants(self) -> None:
        """The tier's invariants; every eviction handed to the tier; each load of the
        step being planned goes to a held device block that holds the loaded hash."""
        self.host_tier.check_invariants()
        assert not self.block_pool.evicted, "evicted hashes not handed to the host tier"
        blocks = self.block_pool.blocks
        for entry, device_block_id in self.host_tier.pending_loads():
            block = blocks[device_block_id]
            assert block.ref_cnt >= 1, f"a load into free device block {device_block_id}"
            assert block.block_hash == entry.block_hash, f"device block {device_block_id} does not hold the hash loaded into it"
