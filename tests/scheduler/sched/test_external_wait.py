"""vLLM's WAITING_FOR_REMOTE_KVS over the external tier (scheduler/sched/external_wait.py,
scheduler/core/offload/external_tier.py), with the real KVCacheManager and Scheduler.

A request whose next blocks the tier holds is parked: its blocks are allocated, not
cached, and the plan carries their load; when the worker says how many blocks it loaded,
the request is admitted with those as computed tokens. Every computed block is saved by
the plan that computes it, once its forward ran (write-through), unless the tier holds it.

The worker is FakeWorker (tests/kvtest/fake_worker.py: it checks every slot a row reads
holds that row's own prefix) with a model of the tier: a dict from key to the prefix keys
of a block's slots. A save copies a block's slots after the plan ran, a load copies them
into its blocks after, so a load into the wrong block, a save of a block not computed
or a recompute of a loaded block is caught by the reads. Block size 4; the prompt is 14
tokens, 3 full blocks and 2 tokens."""

from __future__ import annotations

import pytest
from kvtest.fake_worker import ContractViolation, FakeWorker, fake_sample

from protocol.external_kv import object_key
from protocol.worker_messages import StepPlan, StepResult
from scheduler.core.hashing import BlockHasher
from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.core.offload.external_tier import ExternalTier, KnownKeys
from scheduler.sched.priority_scheduler import PriorityScheduler
from scheduler.sched.request import Request, RequestStatus
from scheduler.sched.scheduler import Scheduler

BS, NUM_BLOCKS, MAX_LEN, VOCAB = 4, 20, 64, 512
HASHER = BlockHasher(BS)
IDENTITY = "ab" * 16
PROMPT = list(range(2, 16))  # 14 tokens: 3 full blocks
STEP_BOUND = 200


def keys_of(tokens: list[int], salt: str | None = None) -> list[str]:
    """The tier's keys of the full blocks of ``tokens``: the worker's identity and each block's hash."""
    return [object_key(IDENTITY, h) for h in HASHER.block_hashes(tokens, salt)]


def expected_output(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(fake_sample(tokens, VOCAB))
    return tokens[len(prompt) :]


class TierWorker:
    """FakeWorker with the external tier: saves and loads after the plan ran, news by `take_done`."""

    def __init__(self, store: dict[str, list[int]], num_blocks: int = NUM_BLOCKS):
        self.fake = FakeWorker(num_blocks, BS, VOCAB)
        self.store = store
        self.num_saved = self.num_loaded = 0
        self._loaded: dict[int, int] = {}
        self._removed: list[str] = []

    def execute(self, plan: StepPlan) -> StepResult:
        ops, slots = plan.external, self.fake.slots
        result = self.fake.execute(plan)
        if ops is not None:
            for block_id, key in zip(ops.save_block_ids, ops.save_keys, strict=True):
                block = [slots.get((block_id, off)) for off in range(BS)]
                if None in block:
                    raise ContractViolation(f"save of block {block_id}, not computed by the plan that saves it")
                self.store[key] = block
                self.num_saved += 1
            held = {b for row in self.fake.rows.values() for b in row.block_ids}
            for load_id, keys, block_ids in zip(ops.load_ids, ops.load_keys, ops.load_block_ids, strict=True):
                if held.intersection(block_ids):
                    raise ContractViolation(f"load {load_id} into blocks a live row holds: {sorted(held.intersection(block_ids))}")
                n = 0
                for key, block_id in zip(keys, block_ids, strict=True):
                    if key not in self.store:
                        break
                    for off, prefix_key in enumerate(self.store[key]):
                        slots[(block_id, off)] = prefix_key
                    n += 1
                # As ExternalIO: the blocks after a miss go from the tier too (they are computed again).
                for key in keys[n:]:
                    self.store.pop(key, None)
                self._removed.extend(keys[n:])
                self._loaded[load_id] = n
                self.num_loaded += n
        return result

    def take_done(self) -> tuple[dict[int, int], list[str]]:
        done = self._loaded, self._removed
        self._loaded, self._removed = {}, []
        return done


class Engine:
    """A scheduler over a manager with a disk tier whose index holds ``keys`` (None: what ``store`` holds)."""

    def __init__(self, store: dict, keys: list[str] | None = None, cls: type[Scheduler] = Scheduler, num_blocks: int = NUM_BLOCKS,
                 max_num_seqs: int = 4):
        self.tier = ExternalTier("disk", BS, KnownKeys())
        self.tier.attach(IDENTITY, list(store) if keys is None else keys)
        self.kv = KVCacheManager(num_blocks, BS, MAX_LEN, external_tier=self.tier)
        self.s = cls(self.kv, max_num_seqs, 64, MAX_LEN)
        self.w = TierWorker(store, num_blocks)
        self.plans: list[StepPlan] = []
        self.outputs: dict[str, list[int]] = {}

    def add(self, rid: str, seq_id: int, prompt: list[int] = PROMPT, max_tokens: int = 3) -> Request:
        r = Request(rid, prompt, max_tokens, seq_id=seq_id, ignore_eos=True, block_hasher=HASHER)
        self.s.add_request(r)
        return r

    def schedule(self):
        out = self.s.schedule()
        if out is not None:
            self.plans.append(out.plan)
        self.kv.check_invariants()
        return out

    def run(self, out) -> None:
        """The worker runs the plan; its sampled tokens are applied."""
        self.s.update_from_output(self.w.execute(out.plan))
        for r in out.scheduled:
            if r.status.is_finished:
                self.outputs[r.request_id] = r.all_token_ids[r.num_prompt_tokens :]
        self.kv.check_invariants()

    def step(self):
        out = self.schedule()
        if out is not None:
            self.run(out)
        return out

    def deliver(self) -> int:
        """The worker's ExternalKVDone, as WorkerSide applies it: keys removed, then loads ended."""
        loaded, removed = self.w.take_done()
        self.tier.removed(removed)
        n = self.s.external_loads_done(loaded)
        self.kv.check_invariants()
        return n

    def drain(self) -> None:
        """Step, delivering the worker's news, until every request finished and every save went out."""
        for _ in range(STEP_BOUND):
            if not self.s.has_unfinished_requests():
                return
            self.step()
            self.deliver()
        raise AssertionError(f"not done in {STEP_BOUND} steps")


def cached(kv: KVCacheManager, tokens: list[int]) -> list[int | None]:
    """The device block caching each full block of ``tokens`` (None: not cached)."""
    return [None if (b := kv.block_pool.get_cached_block(h)) is None else b.block_id for h in HASHER.block_hashes(tokens)]


@pytest.fixture
def warm_store() -> dict[str, list[int]]:
    """The tier after an earlier engine served PROMPT: its 3 full blocks saved."""
    e = Engine({})
    e.add("warm", 0, max_tokens=1)
    e.drain()
    assert sorted(e.w.store) == sorted(keys_of(PROMPT))
    return e.w.store


def free_blocks(e: Engine) -> int:
    return e.kv.block_pool.get_num_free_blocks()


# --- write-through ---------------------------------------------------------------------


def test_computed_blocks_are_saved_by_the_plan_that_computes_them():
    e = Engine({})
    prompt = PROMPT[:9]  # 2 full blocks and 1 token
    r = e.add("r", 3, prompt, max_tokens=1)
    first = e.schedule()
    (row,) = first.plan.new_rows
    # The plan computing them saves them (the worker reads them once its forward ran).
    assert first.plan.external.save_keys == keys_of(prompt) and first.plan.external.save_block_ids == row.block_ids[:2]
    assert first.plan.external.load_ids == []
    e.run(first)
    assert r.status.is_finished
    assert sorted(e.w.store) == sorted(keys_of(prompt)) and e.tier.num_saves == 2
    # Nothing left to save: the finished row is dropped with the next plan, whenever there is one.
    assert e.schedule() is None


def test_a_block_filled_by_decoding_is_saved_by_the_step_that_fills_it():
    e = Engine({})
    prompt = PROMPT[:9]  # decode fills the third block at 12 tokens
    e.add("r", 3, prompt, max_tokens=5)
    e.drain()
    saves = [(p.step_id, p.external.save_keys) for p in e.plans if p.external is not None and p.external.save_keys]
    tokens = prompt + e.outputs["r"]
    # Step 0 computes 9 tokens (2 blocks), steps 1 and 2 positions 9 and 10, step 3 position 11: the third block fills.
    assert saves == [(0, keys_of(prompt)), (3, keys_of(tokens[:12])[2:])]
    assert e.w.num_saved == 3


def test_a_block_the_tier_holds_is_not_saved_again():
    k = keys_of(PROMPT)
    store = {k[1]: [0] * BS}  # the middle block only: no prefix of the request is held
    e = Engine(store)
    r = e.add("r", 1, max_tokens=1)
    out = e.schedule()
    assert r in out.scheduled and out.plan.new_rows[0].num_computed_tokens == 0 and out.plan.external.load_ids == []
    assert out.plan.external.save_keys == [k[0], k[2]]
    assert out.plan.external.save_block_ids == [out.plan.new_rows[0].block_ids[i] for i in (0, 2)]
    assert e.tier.num_saves_skipped == 1
    e.run(out)


# --- parked, then loaded ---------------------------------------------------------------


@pytest.mark.parametrize("cls", [Scheduler, PriorityScheduler])
def test_a_request_the_tier_holds_is_parked_then_admitted_with_its_loaded_tokens(warm_store, cls):
    e = Engine(warm_store, cls=cls)
    r = e.add("r", 5)
    assert e.tier.keys(r.block_hashes) == keys_of(PROMPT)
    out = e.schedule()
    # (a) Parked: no row, no token; the plan carries its load into its first 3 blocks.
    assert out.scheduled == [] and out.plan.new_rows == [] and out.plan.num_scheduled_tokens == {}
    ops = out.plan.external
    block_ids = e.kv.get_block_ids("r")[0]
    assert len(block_ids) == 3
    assert ops.load_ids == [5] and ops.load_keys == [keys_of(PROMPT)] and ops.load_block_ids == [block_ids]
    assert ops.save_keys == []
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS and e.s.num_waiting == 1 and e.s.num_running == 0
    assert all(b.block_hash is None for b in e.kv.req_to_blocks["r"]) and cached(e.kv, PROMPT) == [None] * 3
    assert free_blocks(e) == NUM_BLOCKS - 1 - 3
    e.run(out)
    assert e.schedule() is None  # still loading: nothing to run
    # (b) The worker loaded all 3: the request is admitted with 12 computed tokens, the rest scheduled.
    loaded, removed = e.w.take_done()
    assert (loaded, removed) == ({5: 3}, [])
    assert e.s.external_loads_done({**loaded, 12345: 1}) == 1 and r.status == RequestStatus.WAITING  # an unknown id is skipped
    e.kv.check_invariants()
    assert cached(e.kv, PROMPT) == block_ids
    out = e.schedule()
    assert out.scheduled == [r]
    (row,) = out.plan.new_rows
    assert row.num_computed_tokens == 3 * BS and row.block_ids[:3] == block_ids and out.plan.num_scheduled_tokens == {5: 2}
    assert r.num_cached_tokens == 3 * BS and r.num_external_cached_tokens == 3 * BS
    e.run(out)  # the worker reads positions 0..11 from the loaded blocks: they hold this prefix
    e.drain()
    assert e.outputs["r"] == expected_output(PROMPT, 3)
    assert e.w.num_loaded == 3 and e.tier.num_load_failures == 0
    # The loaded blocks are held by the tier already: never saved again.
    assert not any(set(keys_of(PROMPT)) & set(p.external.save_keys) for p in e.plans if p.external is not None)


def test_a_partial_load_computes_the_rest_and_saves_it_again(warm_store):
    k = keys_of(PROMPT)
    e = Engine(warm_store)
    del warm_store[k[1]]  # the index still claims it: the worker's load stops there
    r = e.add("r", 5)
    out = e.schedule()
    block_ids = out.plan.external.load_block_ids[0]
    e.run(out)
    assert e.deliver() == 1
    assert r.num_computed_tokens == BS and cached(e.kv, PROMPT) == [block_ids[0], None, None]
    assert k[1] not in e.tier.index.keys and k[2] not in e.tier.index.keys  # reported removed
    assert e.tier.num_load_failures == 2
    out = e.schedule()
    (row,) = out.plan.new_rows
    assert row.num_computed_tokens == BS and out.plan.num_scheduled_tokens == {5: 10} and row.block_ids[:3] == block_ids
    assert r.num_cached_tokens == BS and r.num_external_cached_tokens == BS
    # The blocks computed again are saved again by the plan computing them, from the blocks the load left untouched.
    assert out.plan.external.save_keys == k[1:] and out.plan.external.save_block_ids == block_ids[1:]
    e.run(out)
    e.drain()
    assert e.outputs["r"] == expected_output(PROMPT, 3)
    # Every block saved again (and the fourth, filled by decoding).
    assert sorted(warm_store) == sorted(keys_of(PROMPT + e.outputs["r"])) and len(warm_store) == 4


def test_a_load_of_nothing_admits_the_request_with_no_computed_tokens(warm_store):
    e = Engine(warm_store)
    warm_store.clear()
    r = e.add("r", 5)
    e.run(e.schedule())
    assert e.deliver() == 1 and r.num_computed_tokens == 0
    out = e.schedule()
    assert out.plan.new_rows[0].num_computed_tokens == 0 and out.plan.num_scheduled_tokens == {5: 14}
    assert r.num_cached_tokens == 0 and r.num_external_cached_tokens == 0
    e.run(out)
    e.drain()
    assert e.outputs["r"] == expected_output(PROMPT, 3)
    # Every block saved again (and the fourth, filled by decoding).
    assert sorted(warm_store) == sorted(keys_of(PROMPT + e.outputs["r"])) and len(warm_store) == 4


def test_device_hits_come_first_and_only_the_blocks_after_them_load(warm_store):
    k = keys_of(PROMPT)
    e = Engine(warm_store, keys=[])  # the tier's index empty: the first request computes its blocks
    e.add("a", 1, PROMPT[:5], max_tokens=1)  # 1 full block, cached on the device
    e.drain()
    e.tier.index.add(k)
    r = e.add("r", 2)
    out = e.schedule()
    device = cached(e.kv, PROMPT)[0]
    assert device is not None and e.kv.get_block_ids("r")[0][0] == device
    assert out.plan.external.load_keys == [k[1:]] and out.plan.external.load_block_ids == [e.kv.get_block_ids("r")[0][1:3]]
    e.run(out)
    assert e.deliver() == 1 and r.num_computed_tokens == 3 * BS
    out = e.schedule()
    assert out.plan.new_rows[0].num_computed_tokens == 3 * BS
    # Its cached tokens: 3 blocks, of which the 2 loaded count as external.
    assert r.num_cached_tokens == 3 * BS and r.num_external_cached_tokens == 2 * BS
    e.run(out)
    e.drain()
    assert e.outputs["r"] == expected_output(PROMPT, 3)


def test_a_second_request_does_not_hit_blocks_still_loading(warm_store):
    e = Engine(warm_store)
    e.add("a", 1)
    out = e.schedule()
    a_blocks = out.plan.external.load_block_ids[0]
    e.run(out)  # a's load is done on the worker, not reported yet
    b = e.add("b", 2, PROMPT + [99], max_tokens=2)
    hits, n = e.kv.get_computed_blocks(b, record_stats=False)
    assert (hits.blocks, n) == (([],), 0)
    out = e.schedule()
    # b loads into blocks of its own (the tier holds the prefix), none of a's.
    assert out.scheduled == [] and out.plan.external.load_ids == [2]
    assert not set(out.plan.external.load_block_ids[0]) & set(a_blocks) and b.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    e.run(out)
    assert e.deliver() == 2
    out = e.schedule()
    assert [row.num_computed_tokens for row in out.plan.new_rows] == [3 * BS, 3 * BS]
    e.run(out)
    e.drain()
    assert e.outputs == {"a": expected_output(PROMPT, 3), "b": expected_output(PROMPT + [99], 2)}


# --- ended or lost while loading -------------------------------------------------------


def test_an_aborted_loading_request_keeps_its_blocks_until_the_load_is_reported(warm_store):
    e = Engine(warm_store)
    r = e.add("r", 5)
    out = e.schedule()
    held = free_blocks(e)
    assert held == NUM_BLOCKS - 1 - 3
    assert e.s.finish_requests(["r"], RequestStatus.FINISHED_ABORTED) == [r]
    assert r.status == RequestStatus.FINISHED_ABORTED and "r" not in e.s.requests and e.s.num_waiting == 0
    assert free_blocks(e) == held and len(e.kv.req_to_blocks["r"]) == 3  # the worker may still be writing them
    e.kv.check_invariants()
    e.run(out)
    assert e.deliver() == 0  # nobody returns to the queue
    assert free_blocks(e) == NUM_BLOCKS - 1 and "r" not in e.kv.req_to_blocks
    assert not e.s.has_unfinished_requests() and e.schedule() is None  # no row of it to drop: it never had one


def test_a_lost_worker_sends_its_loading_requests_back_to_start_over(warm_store):
    e = Engine(warm_store)
    r = e.add("r", 5)
    e.schedule()  # the plan with the load is in flight when the worker is lost
    # WorkerSide's order on a lost worker.
    e.s.abandon_in_flight()
    e.s.abandon_loads()
    e.s.preempt_all()
    assert r.num_computed_tokens == 0 and r.external_load is None and list(e.s.waiting) == [r]
    assert e.s.num_loading == 0 and e.s.num_waiting == 1
    assert "r" not in e.kv.req_to_blocks and free_blocks(e) == NUM_BLOCKS - 1
    assert e.kv.take_external_ops() is None  # the lost worker's loads are void
    e.kv.check_invariants()
    # A new worker on the same tier: the request parks again and is served.
    e.tier.attach(IDENTITY, list(warm_store))
    e.w = TierWorker(warm_store)
    e.w.fake.expected_step = e.s.next_step_id
    out = e.schedule()
    assert out.plan.external.load_ids == [5]
    e.run(out)
    assert e.deliver() == 1
    e.drain()
    assert e.outputs["r"] == expected_output(PROMPT, 3)


def test_a_preempted_request_whose_blocks_load_comes_back_as_a_resumed_row():
    """A request preempted while running, whose evicted blocks the tier holds, parks on its way
    back. The worker dropped its row at the preemption: the row comes back whole as a resumed
    row (protocol/worker_messages.py RequestRow: "again when it resumes after preemption")."""
    e = Engine({}, num_blocks=9, max_num_seqs=2)  # 8 usable blocks: two 14-token prompts fill them
    e.add("a", 1, PROMPT, max_tokens=14)
    e.add("b", 2, [p + 100 for p in PROMPT], max_tokens=14)
    e.drain()
    parked_after_preemption = [p for p in e.plans if p.external is not None and p.external.load_ids]
    assert e.s.num_preemptions >= 1 and parked_after_preemption
    assert e.outputs == {"a": expected_output(PROMPT, 14), "b": expected_output([p + 100 for p in PROMPT], 14)}


def test_a_loaded_request_behind_a_head_that_cannot_fit_gives_its_blocks_back(warm_store):
    # 7 usable blocks. "a" loads its 3 blocks and waits to be admitted, holding them; "b" (20
    # tokens: 5 blocks) is put ahead of it, as a request preempted meanwhile would be. Nothing
    # runs, so nothing would ever free a block: "a" must give its blocks back for "b" to go.
    e = Engine(warm_store, num_blocks=8)
    a = e.add("a", 1)
    e.run(e.schedule())
    assert e.deliver() == 1 and a.num_computed_tokens == 3 * BS and free_blocks(e) == 4
    b = e.add("b", 2, list(range(100, 120)), max_tokens=1)
    e.s.waiting.remove_ended(b)
    e.s.waiting.appendleft(b)
    out = e.schedule()
    assert [r.request_id for r in out.scheduled] == ["b"] and out.plan.new_rows[0].seq_id == 2
    assert a.status == RequestStatus.WAITING and a.num_computed_tokens == 0 and "a" not in e.kv.req_to_blocks
    e.run(out)
    e.drain()
    assert e.outputs["a"] == expected_output(PROMPT, 3) and e.outputs["b"] == expected_output(list(range(100, 120)), 1)


def test_a_lost_worker_voids_what_a_waiting_request_had_loaded(warm_store):
    # "r" loaded its blocks and waits to be admitted, holding them, when the worker is lost:
    # the new worker's memory holds none of that, so the blocks go and the cache can be reset.
    e = Engine(warm_store)
    r = e.add("r", 5)
    e.run(e.schedule())
    assert e.deliver() == 1 and "r" in e.kv.req_to_blocks and r.num_computed_tokens == 3 * BS
    e.s.abandon_in_flight()
    e.s.abandon_loads()
    e.s.preempt_all()
    assert e.kv.reset_prefix_cache()  # WorkerSide resets the pool: refused while any block is held
    assert "r" not in e.kv.req_to_blocks and r.num_computed_tokens == 0 and list(e.s.waiting) == [r]
    e.kv.check_invariants()
