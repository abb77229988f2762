"""The external tier (disk, Mooncake Store) with hybrid KV-cache groups, with the real
KVCacheManager and Scheduler: block size 4, a full-attention group (0) and a sliding group
(1) of window 8, so a hit of L tokens needs the sliding group's blocks from (L - 7) // 4 on.
A tier key is the worker's identity and a group-keyed hash (the request's hash and the
group id as 4 big-endian bytes), so each group's block of a position has its own key.

The worker is FakeWorker (kvtest.fake_worker, which checks group 0's reads) with a dict
for the tier: a save copies a block's slots after the plan ran, a load copies them back,
so a load of group 0's blocks into the wrong block is caught by the reads."""

from __future__ import annotations

from kvtest.fake_worker import FakeWorker, fake_sample
from kvtest.group_tables import GroupTables

from protocol.external_kv import object_key
from protocol.worker_messages import StepPlan, StepResult
from scheduler.core.hashing import BlockHasher
from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.core.offload.external_tier import ExternalTier, KnownKeys
from scheduler.sched.request import Request, RequestStatus
from scheduler.sched.scheduler import Scheduler

BS, NUM_BLOCKS, MAX_LEN, VOCAB = 4, 24, 64, 512
WINDOWS = [0, 8]
HASHER = BlockHasher(BS)
IDENTITY = "cd" * 16
PROMPT = list(range(2, 16))  # 14 tokens: full blocks 0..2 and 2 tokens
STEP_BOUND = 100


def key(tokens: list[int], i: int, group: int) -> str:
    return object_key(IDENTITY, HASHER.block_hashes(tokens)[i] + bytes([0, 0, 0, group]))


def expected_output(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(fake_sample(tokens, VOCAB))
    return tokens[len(prompt) :]


class TierWorker:
    """FakeWorker with the tier: saves and loads after the plan ran; ``fail``: keys it cannot read."""

    def __init__(self, store: dict[str, list], fail: frozenset[str] = frozenset()):
        self.fake = FakeWorker(NUM_BLOCKS, BS, VOCAB)
        self.tables = GroupTables(len(WINDOWS))
        self.store, self.fail = store, fail
        self.loaded: dict[int, int] = {}

    def execute(self, plan: StepPlan) -> StepResult:
        self.tables.apply(plan)
        ops, slots = plan.external, self.fake.slots
        result = self.fake.execute(plan)
        if ops is not None:
            for block_id, k in zip(ops.save_block_ids, ops.save_keys, strict=True):
                assert block_id != 0, "a null entry saved"
                self.store[k] = [slots.get((block_id, off)) for off in range(BS)]
            for load_id, keys, block_ids in zip(ops.load_ids, ops.load_keys, ops.load_block_ids, strict=True):
                n = 0
                for k, block_id in zip(keys, block_ids, strict=True):
                    if k not in self.store or k in self.fail:
                        break
                    for off, v in enumerate(self.store[k]):
                        if v is not None:
                            slots[(block_id, off)] = v
                    n += 1
                self.loaded[load_id] = n
        return result


class Engine:
    def __init__(self, store: dict[str, list], fail: frozenset[str] = frozenset()):
        self.tier = ExternalTier("disk", BS, KnownKeys())
        self.tier.attach(IDENTITY, list(store))
        self.kv = KVCacheManager(NUM_BLOCKS, BS, MAX_LEN, external_tier=self.tier, group_windows=WINDOWS)
        self.s = Scheduler(self.kv, 4, 64, MAX_LEN)
        self.w = TierWorker(store, fail)
        self.plans: list[StepPlan] = []

    def add(self, rid: str, seq_id: int, max_tokens: int = 3) -> Request:
        r = Request(rid, PROMPT, max_tokens, seq_id=seq_id, ignore_eos=True, block_hasher=HASHER)
        self.s.add_request(r)
        return r

    def run_step(self) -> None:
        """Schedule, and the worker runs the plan (its loads are reported by `deliver`)."""
        out = self.s.schedule()
        self.kv.check_invariants()
        if out is not None:
            self.plans.append(out.plan)
            self.s.update_from_output(self.w.execute(out.plan))
            self.kv.check_invariants()

    def deliver(self) -> None:
        loaded, self.w.loaded = self.w.loaded, {}
        self.s.external_loads_done(loaded)
        self.kv.check_invariants()

    def step(self) -> None:
        self.run_step()
        self.deliver()

    def drain(self) -> None:
        for _ in range(STEP_BOUND):
            if not self.s.has_unfinished_requests():
                return
            self.step()
        raise AssertionError(f"not done in {STEP_BOUND} steps")

    def loads(self) -> list[tuple[list[str], list[int]]]:
        return [(keys, ids) for p in self.plans if p.external is not None
                for keys, ids in zip(p.external.load_keys, p.external.load_block_ids, strict=True)]


def warm_store() -> dict[str, list]:
    """The tier after an earlier engine served PROMPT."""
    e = Engine({})
    r = e.add("warm", 0, max_tokens=1)
    e.drain()
    assert r.all_token_ids[len(PROMPT) :] == expected_output(PROMPT, 1)
    return e.w.store


def test_saves_carry_one_key_per_group_and_block():
    store = warm_store()
    # Full attention saves blocks 0..2; the sliding group only the tail its retention keeps
    # (the 2 blocks ending at the replay boundary 13 // 4 = 3: blocks 1, 2), never a null entry.
    want = {key(PROMPT, i, 0) for i in range(3)} | {key(PROMPT, i, 1) for i in (1, 2)}
    assert set(store) == want and len(want) == 5


def test_a_later_engine_loads_every_needed_block_then_hits_them_on_the_device():
    e = Engine(warm_store())  # a fresh device: the tier is all it has
    r = e.add("r", 1)
    # The tier holds full blocks 0..2 and sliding 1, 2 (the window of 12 reads 5..11):
    # 12 tokens found; the request is parked while they load.
    assert e.kv.get_num_external_hits(r, 0) == 12
    e.run_step()
    assert r.status is RequestStatus.WAITING_FOR_REMOTE_KVS and r.num_computed_tokens == 0
    (keys, block_ids), = e.loads()
    full, sliding = e.kv.get_block_ids("r")
    # The load names exactly the non-null targets: sliding block 0 is a null entry.
    assert sliding[0] == 0
    assert keys == [key(PROMPT, 0, 0), key(PROMPT, 1, 0), key(PROMPT, 1, 1), key(PROMPT, 2, 0), key(PROMPT, 2, 1)]
    assert block_ids == [full[0], full[1], sliding[1], full[2], sliding[2]]
    # Nothing of the load is cached until it is in.
    assert all(e.kv.block_pool.blocks[b].block_hash is None for b in block_ids)
    e.deliver()
    assert r.status is RequestStatus.WAITING and r.num_computed_tokens == 12
    e.drain()
    assert r.all_token_ids[len(PROMPT) :] == expected_output(PROMPT, 3)
    assert e.tier.num_loads == 5 and e.tier.num_load_failures == 0
    # cache_loaded made them device hits: the same prompt hits 12 tokens with no load.
    hits, n = e.kv.get_computed_blocks(Request("again", PROMPT, 1, block_hasher=HASHER), record_stats=False)
    assert n == 12 and hits.get_block_ids() == (full[:3], [0, *sliding[1:3]])


def test_a_short_load_gives_the_blocks_back_and_does_not_load_again():
    store = warm_store()
    # The worker cannot read sliding block 1: it reads 2 of the 5 targets.
    e = Engine(store, fail=frozenset({key(PROMPT, 1, 1)}))
    r = e.add("r", 1)
    free_before = e.kv.block_pool.get_num_free_blocks()
    e.run_step()
    assert r.status is RequestStatus.WAITING_FOR_REMOTE_KVS and len(e.loads()) == 1
    e.deliver()
    assert r.status is RequestStatus.WAITING and r.num_computed_tokens == 0 and next(iter(e.s.waiting)) is r
    assert e.kv.get_block_ids("r") == ([], []) and e.kv.block_pool.get_num_free_blocks() == free_before
    # The failed keys left the index: full block 2 and sliding 1, 2 are no longer found, and
    # without sliding block 0 (never saved) no shorter hit is either.
    assert e.kv.get_num_external_hits(r, 0) == 0
    e.drain()
    assert r.all_token_ids[len(PROMPT) :] == expected_output(PROMPT, 3)
    assert len(e.loads()) == 1 and e.tier.num_load_failures == 3


def test_a_whole_prompt_loaded_keeps_the_window_of_its_last_token():
    kv = KVCacheManager(NUM_BLOCKS, BS, MAX_LEN, group_windows=WINDOWS)
    r = Request("r", list(range(2, 17)), 1, block_hasher=HASHER)  # 15 tokens
    # A load of all 15 (a prefill engine's pull): the last token (14) is computed again, and
    # reads positions 7..14, so the sliding group keeps block 1; only block 0 is null.
    assert kv.allocate_slots(r, 15, 0, None, delay_cache=True) is not None
    full, sliding = kv.get_block_ids("r")
    assert len(full) == len(sliding) == 4 and sliding[0] == 0 and 0 not in sliding[1:]
    assert [g for g, _, _ in kv.load_targets("r", 0, 4)] == [0, 0, 1, 0, 1, 0, 1]
    kv.cache_loaded(r, 14)
    kv.check_invariants()
