"""HostTier: the offload tier, a second pool of KV blocks in host memory.

vLLM's native offloading (`--kv-offloading-size`, vllm/v1/kv_offload/) as the
scheduler's side of it: host *slots* are numbers, as device blocks are; the
worker holds the memory (one host tensor per layer) and runs the copies a plan
names. The discipline is the device pool's:

* keyed by block hash, one hash -> one slot (a copy is never stored twice:
  a store of a hash the tier holds is skipped, and counted);
* an eviction policy object orders the slots that may be reused
  (`scheduler/core/retention/lru_policy.py`; LRU, as vLLM's default);
* ref counts for transfers in flight: a slot with a load in this step's plan
  (or the plan in flight) is pinned, and a slot whose store has not completed
  is not ready; neither can be evicted, so no later store overwrites a slot
  before the copy that reads it ran.

A step's copies (`take_copies`) are parallel lists in `HostTierCopies`, plain
data the policy layer puts in its plan as the wire `TierCopies`; the worker
runs every store (device block -> host slot), then every load (host slot ->
device block), before any token of the step is written or read
(protocol/worker_messages.py). `complete_copies` marks them done once the
step's result is in.

NOTE: a hash whose store is in this step's plan, or in the plan in flight, is
already a hit for a load (`lookup` counts it). vLLM's transfers are
asynchronous, so its manager waits for the store (ref_cnt -1) before it serves a
hit; here the copies are part of the plan and plans run in order, stores
before loads within one, so by the time the load runs the store has run.
Readiness still decides eviction and the CPU BlockStored event (sent, as vLLM's
offloading connector does, when the store completes).

Counters (plain ints, read by the process loop): stores, loads, stores skipped
(hash already held), stores dropped (every slot pinned), evictions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from protocol.kv_events import MEDIUM_CPU
from scheduler.core.kv_cache_block import BlockHash
from scheduler.core.kv_events import KVEventSink
from scheduler.core.retention.lru_policy import EvictionPolicy, LRUPolicy


@dataclass(slots=True)
class HostTierCopies:
    """A step's copies, as parallel lists: device block store_device_ids[i] into
    host slot store_host_ids[i] (every store first), then host slot load_host_ids[i]
    into device block load_device_ids[i]."""

    store_device_ids: list[int]
    store_host_ids: list[int]
    load_host_ids: list[int]
    load_device_ids: list[int]


class HostBlock:
    """One host slot holding the KV of one block hash."""

    __slots__ = ("slot", "block_hash", "ref_cnt", "is_ready")

    def __init__(self, slot: int, block_hash: BlockHash):
        self.slot = slot
        self.block_hash = block_hash
        # Loads in flight reading this slot (this step's plan and the plan in flight).
        self.ref_cnt = 0
        # False until the step carrying its store completed.
        self.is_ready = False

    def __repr__(self) -> str:
        return f"HostBlock(slot={self.slot}, hash={self.block_hash.hex()[:8]}, ref_cnt={self.ref_cnt}, ready={self.is_ready})"


class HostTier:
    """``num_host_blocks`` slots (0..n-1) of ``block_size`` tokens, keyed by hash.

    A step's life (KVCacheManager drives it; the simulator through the manager):
    `lookup` (admission), `pin` then `add_loads` (host hits get device blocks),
    `prepare_stores` (blocks leaving the device, or write-through), `take_copies`
    (the plan's HostTierCopies), `complete_copies` (the step's result is in). `clear`
    on a reset or a lost worker. Read-only for callers: `blocks`, the counters,
    `num_cached_blocks`, `num_pinned_blocks`, `get_usage`."""

    def __init__(
        self,
        num_host_blocks: int,
        block_size: int,
        event_sink: KVEventSink | None = None,
        policy: EvictionPolicy | None = None,
    ):
        if num_host_blocks < 1:
            raise ValueError(f"num_host_blocks must be at least 1, got {num_host_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_host_blocks = num_host_blocks
        self.block_size = block_size
        self.event_sink = event_sink
        self.policy: EvictionPolicy = LRUPolicy() if policy is None else policy
        self.blocks: dict[BlockHash, HostBlock] = {}
        # Unused slots; popped from the end, so slot 0 is used first.
        self._free_slots: list[int] = list(range(num_host_blocks - 1, -1, -1))
        # This step's copies, in plan order (parallel lists).
        self._store_blocks: list[HostBlock] = []
        self._store_device_ids: list[int] = []
        self._load_blocks: list[HostBlock] = []
        self._load_device_ids: list[int] = []
        # The copies of the plan in flight, until complete_copies().
        self._in_flight_stores: list[HostBlock] = []
        self._in_flight_loads: list[HostBlock] = []
        # Counters, in blocks (never reset here).
        self.num_stores = 0
        self.num_loads = 0
        self.num_stores_skipped = 0
        self.num_stores_dropped = 0
        self.num_evictions = 0

    # --- lookups and loads ------------------------------------------------------------

    def lookup(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many of ``block_hashes``, from the first, the tier holds (see the
        module's NOTE: a store not yet completed counts)."""
        blocks = self.blocks
        n = 0
        for block_hash in block_hashes:
            if block_hash not in blocks:
                break
            n += 1
        return n

    def held(self, block_hashes: Sequence[BlockHash]) -> list[bool]:
        """For each hash, whether the tier holds it (a store pending counts, as in `lookup`)."""
        blocks = self.blocks
        return [h in blocks for h in block_hashes]

    def pin(self, block_hashes: Sequence[BlockHash]) -> list[HostBlock]:
        """Protect the entries of ``block_hashes`` from eviction before their loads
        are added (the device blocks they go to are allocated in between, and an
        allocation can evict device blocks whose stores need host slots).
        Raises KeyError, pinning nothing, if one is missing."""
        entries = [self.blocks[h] for h in block_hashes]
        policy = self.policy
        for entry in entries:
            if entry.ref_cnt == 0 and entry.is_ready:
                policy.remove(entry.block_hash)
            entry.ref_cnt += 1
        return entries

    def add_loads(self, entries: Sequence[HostBlock], device_block_ids: Sequence[int]) -> None:
        """Load each pinned entry into the device block beside it, in this step's plan."""
        if len(entries) != len(device_block_ids):
            raise ValueError(f"{len(entries)} host entries for {len(device_block_ids)} device blocks")
        self._load_blocks.extend(entries)
        self._load_device_ids.extend(device_block_ids)
        self.num_loads += len(entries)

    # --- stores -----------------------------------------------------------------------

    def prepare_stores(self, evicted: Sequence[tuple[int, BlockHash]]) -> None:
        """Copy each device block (id, the hash it holds) into a host slot in this
        step's plan, in order: the manager's per-allocation batch. A store is skipped
        when the tier holds the hash already, and dropped when no slot is free and
        none evictable. A slot comes from the free list, else from the policy's
        victim (a CPU BlockRemoved). NOTE: names bound once: this runs for every
        block evicted from the device."""
        blocks = self.blocks
        free_slots = self._free_slots
        evict = self.policy.evict
        sink = self.event_sink
        store_blocks, store_device_ids = self._store_blocks, self._store_device_ids
        num_stored = num_skipped = num_evicted = 0
        for device_block_id, block_hash in evicted:
            if block_hash in blocks:
                num_skipped += 1
                continue
            if free_slots:
                slot = free_slots.pop()
            else:
                victim = evict()
                if victim is None:
                    self.num_stores_dropped += 1
                    continue
                slot = blocks.pop(victim).slot
                num_evicted += 1
                if sink is not None:
                    sink.block_removed(victim, MEDIUM_CPU)
            entry = blocks[block_hash] = HostBlock(slot, block_hash)
            store_blocks.append(entry)
            store_device_ids.append(device_block_id)
            num_stored += 1
        self.num_stores += num_stored
        self.num_stores_skipped += num_skipped
        self.num_evictions += num_evicted

    # --- the step's copies ------------------------------------------------------------

    def take_copies(self) -> HostTierCopies | None:
        """This step's copies for its plan (None when there are none); they are in
        flight until `complete_copies`."""
        if not self._store_blocks and not self._load_blocks:
            return None
        if self._in_flight_stores or self._in_flight_loads:
            raise RuntimeError("the copies of the plan in flight were not completed (complete_copies)")
        copies = HostTierCopies(
            self._store_device_ids, [e.slot for e in self._store_blocks], [e.slot for e in self._load_blocks], self._load_device_ids
        )
        self._in_flight_stores, self._store_blocks, self._store_device_ids = self._store_blocks, [], []
        self._in_flight_loads, self._load_blocks, self._load_device_ids = self._load_blocks, [], []
        return copies

    def complete_copies(self) -> None:
        """The plan in flight ran (its result is in): its stores are ready, its
        loads unpin their slots."""
        insert = self.policy.insert
        stored: list[BlockHash] = []
        append = stored.append
        for entry in self._in_flight_stores:
            entry.is_ready = True
            append(entry.block_hash)
            if entry.ref_cnt == 0:
                insert(entry.block_hash)
        for entry in self._in_flight_loads:
            entry.ref_cnt -= 1
            if entry.ref_cnt == 0 and entry.is_ready:
                insert(entry.block_hash)
        self._in_flight_stores = []
        self._in_flight_loads = []
        if stored and self.event_sink is not None:
            # As vLLM's offloading connector: one event, no parent, no tokens.
            self.event_sink.block_stored(stored, None, [], self.block_size, MEDIUM_CPU)

    def clear(self) -> None:
        """Forget every entry, and the copies not yet completed (a prefix-cache
        reset, a lost worker: the host memory's contents are void)."""
        if self.event_sink is not None:
            for block_hash, entry in self.blocks.items():
                if entry.is_ready:
                    self.event_sink.block_removed(block_hash, MEDIUM_CPU)
        self.blocks.clear()
        self.policy.clear()
        self._free_slots = list(range(self.num_host_blocks - 1, -1, -1))
        self._store_blocks, self._store_device_ids, self._load_blocks, self._load_device_ids = [], [], [], []
        self._in_flight_stores, self._in_flight_loads = [], []

    # --- accounting -------------------------------------------------------------------

    @property
    def num_cached_blocks(self) -> int:
        """Slots holding a hash (stored or being stored)."""
        return len(self.blocks)

    @property
    def num_pinned_blocks(self) -> int:
        """Slots that cannot be evicted now: a store not completed, or a load in flight."""
        return len(self.blocks) - len(self.policy)

    def get_usage(self) -> float:
        """Pinned slots over all slots: vllm:kv_offload_cpu_cache_usage_perc, as vLLM
        computes it (0 when no copy is in flight, however full the tier)."""
        return self.num_pinned_blocks / self.num_host_blocks

    def pending_loads(self) -> list[tuple[HostBlock, int]]:
        """This step's loads so far, (entry, device block id) (tests, invariants)."""
        return list(zip(self._load_blocks, self._load_device_ids, strict=True))

    def check_invariants(self) -> None:
        """Raise AssertionError on any inconsistency (tests; O(num_host_blocks))."""
        n = self.num_host_blocks
        free = self._free_slots
        assert len(set(free)) == len(free), "a free slot is listed twice"
        used = [e.slot for e in self.blocks.values()]
        assert len(set(used)) == len(used), "two hashes share a host slot"
        assert not set(free) & set(used), "a slot is both free and used"
        assert sorted(free + used) == list(range(n)), "slots lost or out of range"
        stores = self._store_blocks + self._in_flight_stores
        assert len(self._store_blocks) == len(self._store_device_ids)
        assert len(self._load_blocks) == len(self._load_device_ids)
        assert all(d >= 1 for d in self._store_device_ids + self._load_device_ids), "a copy names the null block"
        loads_of: dict[int, int] = {}
        for entry in self._load_blocks + self._in_flight_loads:
            loads_of[id(entry)] = loads_of.get(id(entry), 0) + 1
        pending = {id(e) for e in stores}
        assert len(pending) == len(stores), "one entry stored twice"
        for block_hash, entry in self.blocks.items():
            assert entry.block_hash == block_hash, f"slot {entry.slot}: entry disagrees with its key"
            assert entry.ref_cnt == loads_of.pop(id(entry), 0), f"slot {entry.slot}: ref_cnt {entry.ref_cnt} != its loads in flight"
            assert entry.is_ready == (id(entry) not in pending), f"slot {entry.slot}: ready {entry.is_ready} disagrees with its store"
            evictable = entry.is_ready and entry.ref_cnt == 0
            assert (block_hash in self.policy) == evictable, f"slot {entry.slot}: in the policy {not evictable}, evictable {evictable}"
        assert not loads_of, "a load reads a slot the tier no longer holds"
        for entry in stores:
            assert self.blocks.get(entry.block_hash) is entry, f"slot {entry.slot}: a store of an entry the tier dropped"
        assert len(self.policy) == sum(e.is_ready and e.ref_cnt == 0 for e in self.blocks.values())
