"""Property-based tests: the BlockPool (and TailBlockPool) against a plain model
(the KVCacheManager under random requests: test_kv_cache_manager_stateful.py).

The model is deliberately naive — Python lists and dicts, no links — so that it
and the pool can only agree if the pool's linked list, counters and hash map all
do what the spec says:

* get_new_blocks takes from the front; a block with a hash loses it then (lazy
  eviction), and the map keeps the hash while another block still holds it;
* touch takes a free block out of the queue wherever it is;
* free_blocks: ref_cnt 0 and no hash (or caching off) -> front, in the order
  given; with a hash -> back, in the order given (TailBlockPool: all to the back);
* the map keeps every block of a hash, in insertion order; a lookup gets the first;
* KV events: BlockStored for runs of hashes no block held, BlockRemoved when the
  last block of a hash loses it, AllBlocksCleared on a reset.

Hashes come from a small set (h0..h5) so that duplicates are common.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from scheduler.core.block_pool import BlockPool
from scheduler.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventRecorder
from simulator.free_policies import TailBlockPool

HASHES = [f"h{i}".encode() for i in range(6)]
FREE_ORDERS = ("reversed", "forward", "random")

# 200 examples x 50 steps x 4 pool variants = 40,000 pool steps, plus the manager.
POOL_SETTINGS = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


class PoolModel:
    """What the pool should look like: ids only."""

    def __init__(self, num_blocks: int, enable_caching: bool, tail: bool):
        self.enable_caching = enable_caching
        self.tail = tail
        self.ref = {i: 0 for i in range(1, num_blocks)}
        self.hash: dict[int, bytes | None] = {i: None for i in range(1, num_blocks)}
        self.queue = list(range(1, num_blocks))  # front first; block 0 is the null block
        self.map: dict[bytes, list[int]] = {}  # hash -> block ids, insertion order
        self.num_evictions = 0
        self.events: list = []  # the KV events the pool should have sent, in order

    def allocate(self, n: int) -> list[int]:
        taken, self.queue = self.queue[:n], self.queue[n:]
        for i in taken:
            h = self.hash[i]
            if h is not None:
                self.map[h].remove(i)
                if not self.map[h]:
                    del self.map[h]
                    self.events.append(BlockRemoved([h]))
                self.hash[i] = None
                self.num_evictions += 1
            self.ref[i] = 1
        return taken

    def touch(self, ids: list[int]) -> None:
        for i in ids:
            if self.ref[i] == 0:
                self.queue.remove(i)
            self.ref[i] += 1

    def free(self, ids: list[int]) -> None:
        first, last = [], []
        for i in ids:
            self.ref[i] -= 1
            if self.ref[i] == 0:
                if self.tail or (self.hash[i] is not None and self.enable_caching):
                    last.append(i)
                else:
                    first.append(i)
        self.queue = first + self.queue + last

    def cache(self, ids: list[int], hashes: list[bytes], skip: int, tokens: list[int], block_size: int) -> None:
        """Hash ids[skip:] with hashes[skip:]; ids[:skip] count as cached already."""
        if not self.enable_caching:
            return
        new = []
        for pos in range(skip, len(ids)):
            i, h = ids[pos], hashes[pos]
            if h not in self.map:
                new.append(pos)
            self.hash[i] = h
            self.map.setdefault(h, []).append(i)
        # One BlockStored per run of consecutive positions whose hash was new.
        runs: list[list[int]] = []
        for pos in new:
            if runs and runs[-1][-1] == pos - 1:
                runs[-1].append(pos)
            else:
                runs.append([pos])
        for run in runs:
            parent = hashes[run[0] - 1] if run[0] > 0 else None
            toks = tokens[run[0] * block_size : (run[-1] + 1) * block_size]
            self.events.append(BlockStored([hashes[p] for p in run], parent, toks, block_size))

    def reset(self) -> bool:
        if any(self.ref.values()):
            return False
        for i in self.hash:
            self.hash[i] = None
        self.map.clear()
        self.events.append(AllBlocksCleared())
        return True

    def lookup(self, h: bytes) -> int | None:
        ids = self.map.get(h)
        return ids[0] if ids else None

    @property
    def num_free_cached(self) -> int:
        return sum(self.hash[i] is not None for i in self.queue)


class PoolMachine(RuleBasedStateMachine):
    POOL_CLASS: type[BlockPool] = BlockPool
    ENABLE_CACHING = True

    def __init__(self) -> None:
        super().__init__()
        self.pool: BlockPool | None = None
        self.model: PoolModel | None = None
        # Each owner is a "request": the block ids it holds, in table order.
        self.owners: list[list[int]] = []

    @initialize(num_blocks=st.integers(2, 12))
    def make_pool(self, num_blocks):
        self.events = KVEventRecorder()
        self.pool = self.POOL_CLASS(num_blocks, enable_caching=self.ENABLE_CACHING, event_sink=self.events)
        self.model = PoolModel(num_blocks, self.ENABLE_CACHING, tail=self.POOL_CLASS is TailBlockPool)

    # --- rules ------------------------------------------------------------------------

    @rule(n=st.integers(0, 13), join=st.integers(-1, 20))
    def allocate(self, n, join):
        pool, model = self.pool, self.model
        if n > len(model.queue):
            before = self.snapshot()
            try:
                pool.get_new_blocks(n)
            except ValueError:
                pass
            else:
                raise AssertionError(f"get_new_blocks({n}) with {len(model.queue)} free did not raise")
            assert self.snapshot() == before, "a refused get_new_blocks changed the pool"
            return
        got = [b.block_id for b in pool.get_new_blocks(n)]
        assert got == model.allocate(n)
        self.give(got, join)

    @rule(picks=st.lists(st.sampled_from(HASHES), min_size=1, max_size=4), join=st.integers(-1, 20))
    def touch_cached(self, picks, join):
        """A cache hit: look hashes up, touch what is found (free or held blocks)."""
        blocks = [b for b in map(self.pool.get_cached_block, picks) if b is not None]
        ids = [b.block_id for b in blocks]
        assert ids == [i for i in map(self.model.lookup, picks) if i is not None]
        if not blocks:
            return
        self.pool.touch(blocks)
        self.model.touch(ids)
        self.give(ids, join)

    @precondition(lambda self: self.owners)
    @rule(which=st.integers(0, 100), order=st.sampled_from(FREE_ORDERS), rnd=st.randoms(use_true_random=False))
    def free(self, which, order, rnd):
        ids = self.owners.pop(which % len(self.owners))
        if order == "reversed":
            ids = ids[::-1]
        elif order == "random":
            rnd.shuffle(ids)
        self.pool.free_blocks([self.pool.blocks[i] for i in ids])
        self.model.free(ids)

    @precondition(lambda self: self.owners)
    @rule(which=st.integers(0, 100), hashes=st.lists(st.sampled_from(HASHES), min_size=1, max_size=6), skip=st.integers(0, 3))
    def cache(self, which, hashes, skip):
        """cache_full_blocks on an owner's blocks that have no hash yet, some of them
        already counted as cached (num_cached_blocks = skip)."""
        owner = self.owners[which % len(self.owners)]
        fresh = [i for i in dict.fromkeys(owner) if self.pool.blocks[i].block_hash is None]
        n = min(len(fresh), len(hashes))
        if n == 0:
            return
        skip = min(skip, n)
        # Blocks before `skip` play the part of already-cached ones: never touched.
        blocks = [self.pool.blocks[i] for i in fresh[:n]]
        tokens = list(range(100, 100 + 2 * n))
        self.pool.cache_full_blocks(blocks, hashes[:n], skip, n, tokens, 2)
        self.model.cache(fresh[:n], hashes[:n], skip, tokens, 2)

    @rule(h=st.sampled_from(HASHES))
    def lookup(self, h):
        b = self.pool.get_cached_block(h)
        assert (b.block_id if b is not None else None) == self.model.lookup(h)

    @rule()
    def reset_prefix_cache(self):
        assert self.pool.reset_prefix_cache() == self.model.reset()

    @precondition(lambda self: self.owners)
    @rule()
    def free_everything_then_reset(self):
        for ids in self.owners:
            self.pool.free_blocks([self.pool.blocks[i] for i in reversed(ids)])
            self.model.free(ids[::-1])
        self.owners.clear()
        assert self.pool.reset_prefix_cache() is True
        assert self.model.reset() is True

    # --- helpers ----------------------------------------------------------------------

    def give(self, ids: list[int], join: int) -> None:
        """Hand blocks to a new owner (join < 0 or no owners) or extend an existing one."""
        if join < 0 or not self.owners:
            self.owners.append(list(ids))
        else:
            self.owners[join % len(self.owners)].extend(ids)

    def snapshot(self):
        pool = self.pool
        return (
            [b.block_id for b in pool.free_block_queue],
            [(b.block_id, b.ref_cnt, b.block_hash) for b in pool.blocks],
            sorted((k, b.block_id) for k, b in pool.cached_block_hash_to_block.items()),
            pool.num_evictions,
            pool.num_free_cached_blocks,
        )

    # --- after every step -------------------------------------------------------------

    @invariant()
    def agrees_with_the_model(self):
        pool, model = self.pool, self.model
        if pool is None:
            return
        pool.check_invariants()
        assert [b.block_id for b in pool.free_block_queue] == model.queue
        assert {b.block_id: b.ref_cnt for b in pool.blocks[1:]} == model.ref
        assert {b.block_id: b.block_hash for b in pool.blocks[1:]} == model.hash
        got_map: dict[bytes, list[int]] = {}
        for k, b in pool.cached_block_hash_to_block.items():
            got_map.setdefault(k, []).append(b.block_id)
        assert got_map == model.map
        for h in HASHES:
            b = pool.get_cached_block(h)
            assert (b.block_id if b is not None else None) == model.lookup(h)
        assert pool.get_num_free_blocks() == len(model.queue)
        assert pool.get_usage() == 1.0 - len(model.queue) / (pool.num_gpu_blocks - 1)
        assert pool.num_evictions == model.num_evictions
        assert pool.num_free_cached_blocks == model.num_free_cached
        assert pool.null_block.ref_cnt == 0
        assert self.events.take_events() == model.events
        model.events.clear()
        # Every held block is held by as many owners as its ref_cnt says.
        owned: dict[int, int] = {}
        for ids in self.owners:
            for i in ids:
                owned[i] = owned.get(i, 0) + 1
        assert owned == {i: r for i, r in model.ref.items() if r}
        if not self.ENABLE_CACHING:
            assert len(pool.cached_block_hash_to_block) == 0


def machine(pool_class: type[BlockPool], enable_caching: bool):
    cls = type(
        f"{pool_class.__name__}Caching{enable_caching}",
        (PoolMachine,),
        {"POOL_CLASS": pool_class, "ENABLE_CACHING": enable_caching},
    )
    cls.TestCase.settings = POOL_SETTINGS
    return cls.TestCase


TestBlockPoolCaching = machine(BlockPool, True)
TestBlockPoolNoCaching = machine(BlockPool, False)
TestTailBlockPoolCaching = machine(TailBlockPool, True)
TestTailBlockPoolNoCaching = machine(TailBlockPool, False)
