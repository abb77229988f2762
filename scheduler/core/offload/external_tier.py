"""ExternalTier: the scheduler's side of the external KV tier (a disk directory, a Mooncake Store).

vLLM's KV connector, scheduler role, for a tier that outlives the engine: the manager's
second source of computed tokens. It answers how many of a request's next blocks the tier
holds (`lookup`, vLLM's ``get_num_new_matched_tokens``), records the loads of the blocks an
admission allocated for them (``update_state_after_alloc``), and saves every block once
it is computed (write-through: a block is in the plan that computes it, and the worker
reads it once that plan's forward ran). The worker moves the bytes, off the
step path; the scheduler never touches them.

What the tier holds is the ``KeyIndex``'s to say: for a directory, the keys the worker
listed at its hello plus every save since, less what the worker reports removed
(`KnownKeys`); a store shared with other engines is asked (scheduler/core/offload/mooncake_index.py).
A key the index claims but the tier no longer has is only a miss: the worker's load fails
the check and the block is computed again.

Keys: protocol/external_kv.py (the worker's identity and the block hash).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from protocol.external_kv import object_key
from scheduler.core.kv_cache_block import BlockHash, KVCacheBlock


class KeyIndex(Protocol):
    """Which keys the tier holds, as far as the scheduler can tell."""

    def count_prefix(self, keys: Sequence[str]) -> int:
        """How many of ``keys``, from the first, the tier holds."""
        ...

    def missing(self, keys: Sequence[str]) -> list[bool]:
        """For each key, True when the tier does not hold it (it should be saved)."""
        ...

    def add(self, keys: Iterable[str]) -> None:
        """Saves sent: count these as held (a load queued after a save reads it)."""
        ...

    def discard(self, keys: Iterable[str]) -> None:
        """The worker reported these gone (evicted, failed, bad)."""
        ...

    def reset(self, keys: Iterable[str]) -> None:
        """A worker's hello: what its tier holds now."""
        ...


class KnownKeys:
    """The index of a tier only this engine writes (a local directory): a set."""

    def __init__(self) -> None:
        self.keys: set[str] = set()

    def count_prefix(self, keys: Sequence[str]) -> int:
        held = self.keys
        n = 0
        for key in keys:
            if key not in held:
                break
            n += 1
        return n

    def missing(self, keys: Sequence[str]) -> list[bool]:
        held = self.keys
        return [k not in held for k in keys]

    def add(self, keys: Iterable[str]) -> None:
        self.keys.update(keys)

    def discard(self, keys: Iterable[str]) -> None:
        self.keys.difference_update(keys)

    def reset(self, keys: Iterable[str]) -> None:
        self.keys = set(keys)

    def __len__(self) -> int:
        return len(self.keys)


# Keys memoised before the memo starts over (about 150 MB at most).
MAX_KEY_MEMO = 1 << 20


@dataclass(slots=True)
class ExternalOps:
    """A step's saves (device block, key) and loads (load id, keys, device blocks)."""

    save_block_ids: list[int] = field(default_factory=list)
    save_keys: list[str] = field(default_factory=list)
    load_ids: list[int] = field(default_factory=list)
    load_keys: list[list[str]] = field(default_factory=list)
    load_block_ids: list[list[int]] = field(default_factory=list)


class ExternalTier:
    """The ``backend`` tier ("disk" or "mooncake") over ``index``, for blocks of ``block_size`` tokens."""

    def __init__(self, backend: str, block_size: int, index: KeyIndex):
        self.backend = backend
        self.block_size = block_size
        self.index = index
        # The worker's identity (WorkerHello.external_identity): keys are made from it.
        self.identity = ""
        # block hash -> its key, for this identity (cleared past MAX_KEY_MEMO entries).
        self._key_memo: dict[BlockHash, str] = {}
        # (device block id, hash) cached by the step being scheduled: computed by its plan, and
        # saved once that plan's forward ran.
        self._written: list[tuple[int, BlockHash]] = []
        self._ops = ExternalOps()
        # Counters, in blocks (never reset): saves sent, saves skipped (held already), loads sent
        # (the hits admissions claimed), blocks whose load failed, keys reported removed.
        self.num_saves = 0
        self.num_saves_skipped = 0
        self.num_loads = 0
        self.num_load_failures = 0
        self.num_removed = 0

    def attach(self, identity: str, keys: Iterable[str]) -> None:
        """A worker said hello: its identity, and (a directory) what it holds. Whatever
        was planned for the worker before is void."""
        if not identity:
            raise ValueError(f"the worker has no {self.backend} tier (its hello carries no identity)")
        if identity != self.identity:
            self._key_memo.clear()
        self.identity = identity
        self.index.reset(keys)
        self.clear()

    def keys(self, block_hashes: Sequence[BlockHash]) -> list[str]:
        """The keys of ``block_hashes``, memoised: a waiting head is looked up again every step
        it waits, and each key is a digest."""
        memo = self._key_memo
        out = [memo.get(h) for h in block_hashes]
        if None in out:
            if len(memo) > MAX_KEY_MEMO:
                memo.clear()
            identity = self.identity
            for i, (h, key) in enumerate(zip(block_hashes, out, strict=True)):
                if key is None:
                    out[i] = memo[h] = object_key(identity, h)
        return out

    # --- loads ------------------------------------------------------------------------

    def lookup(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many of ``block_hashes``, from the first, the tier holds."""
        return self.index.count_prefix(self.keys(block_hashes)) if block_hashes else 0

    def held(self, block_hashes: Sequence[BlockHash]) -> list[bool]:
        """For each hash, whether the tier holds it."""
        return [not m for m in self.index.missing(self.keys(block_hashes))] if block_hashes else []

    def drop(self, block_hashes: Sequence[BlockHash]) -> None:
        """Forget these hashes' keys: a load of them failed, so no lookup may find them again
        (whatever the worker reports removed)."""
        self.index.discard(self.keys(block_hashes))

    def add_load(self, load_id: int, block_hashes: Sequence[BlockHash], blocks: Sequence[KVCacheBlock]) -> None:
        """Load the blocks of ``block_hashes`` into ``blocks`` (new, uncached), in this step's plan."""
        if len(block_hashes) != len(blocks):
            raise ValueError(f"{len(block_hashes)} hashes to load into {len(blocks)} blocks")
        ops = self._ops
        ops.load_ids.append(load_id)
        ops.load_keys.append(self.keys(block_hashes))
        ops.load_block_ids.append([b.block_id for b in blocks])
        self.num_loads += len(blocks)

    def loaded(self, num_requested: int, num_loaded: int) -> None:
        """A load ended: ``num_loaded`` of its ``num_requested`` blocks were read and checked."""
        self.num_load_failures += num_requested - num_loaded

    def removed(self, keys: Sequence[str]) -> None:
        """The worker reports these keys gone from the tier."""
        self.index.discard(keys)
        self.num_removed += len(keys)

    # --- saves ------------------------------------------------------------------------

    def add_written(self, req_blocks: list[KVCacheBlock], block_hashes: Sequence[BlockHash], start: int, end: int) -> None:
        """Blocks ``start`` .. ``end - 1`` of a table were just cached: the plan being built
        computes them, and saves them once its forward ran."""
        self._written.extend((req_blocks[i].block_id, block_hashes[i]) for i in range(start, end))

    def forget_written(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Blocks cached in the step being planned that it will not compute after all."""
        block_ids = {b.block_id for b in blocks}
        self._written = [w for w in self._written if w[0] not in block_ids]

    # --- the step's ops ---------------------------------------------------------------

    def take_ops(self) -> ExternalOps | None:
        """The saves and loads for the plan being built (None: none). Call once per
        plan, after every allocation of the step."""
        written, ops = self._written, self._ops
        if not written and not ops.load_ids:
            return None  # NOTE: most decode steps: nothing allocated
        self._written, self._ops = [], ExternalOps()
        if written:
            keys = self.keys([h for _, h in written])
            missing = self.index.missing(keys)
            seen: set[str] = set()
            for (block_id, _), key, is_missing in zip(written, keys, missing, strict=True):
                if not is_missing or key in seen:
                    self.num_saves_skipped += 1
                    continue
                seen.add(key)
                ops.save_block_ids.append(block_id)
                ops.save_keys.append(key)
            self.index.add(ops.save_keys)
            self.num_saves += len(ops.save_keys)
        if not ops.save_keys and not ops.load_ids:
            return None
        return ops

    def clear(self) -> None:
        """Forget every save and load not yet sent (a lost worker). The tier keeps what it holds."""
        self._written.clear()
        self._ops = ExternalOps()
