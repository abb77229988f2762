"""--scheduling-policy priority (scheduler/sched/priority_scheduler.py), step by step
against the fake worker: admission by (priority, arrival), the victim rule (the
running request with the largest (priority, arrival_time), wherever it stands, as
vLLM 0.32 picks it), a victim scheduled earlier in its step leaving it, a waiting
request never preempting, and fcfs ignoring the field. Block size 4 throughout;
``[L0 L1]`` is a block table, ``*`` a block cached by the step being planned."""

from __future__ import annotations

from kvtest.fake_worker import FakeWorker

from protocol.worker_messages import AppendedBlocks
from scheduler.core.hashing import BlockHasher
from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.sched.priority_scheduler import PriorityScheduler, scheduler_class
from scheduler.sched.request import Request, RequestStatus
from scheduler.sched.scheduler import Scheduler

BS = 4


def make(policy: str, num_blocks: int, caching: bool = False, budget: int = 64):
    kv = KVCacheManager(num_blocks, BS, 64, enable_caching=caching)
    return scheduler_class(policy)(kv, 8, budget, 64), FakeWorker(num_blocks, BS)


def add(sched, rid: str, prompt_len: int, priority: int, arrival: float, seq_id: int, max_tokens: int = 5) -> Request:
    r = Request(rid, [2 + (seq_id * 5 + i) % 40 for i in range(prompt_len)], max_tokens, seq_id=seq_id, priority=priority,
                arrival_time=arrival, ignore_eos=True, block_hasher=BlockHasher(BS))
    sched.add_request(r)
    return r


def step(sched, worker):
    out = sched.schedule()
    sched.update_from_output(worker.execute(out.plan))
    return out


def ids(requests) -> list[str]:
    return [r.request_id for r in requests]


def test_admission_by_priority_then_arrival_and_victims_lowest_priority_latest_first():
    # 4 usable blocks; four 4-token prompts take one block each (all admitted).
    s, w = make("priority", 5)
    for rid, prio, t, i in (("a", 0, 1.0, 0), ("b", 2, 2.0, 1), ("c", 2, 3.0, 2), ("d", 1, 4.0, 3)):
        add(s, rid, 4, prio, t, i)
    out = step(s, w)
    # waiting heap (priority, arrival): a(0,1) < d(1,4) < b(2,2) < c(2,3)
    assert ids(out.scheduled) == ids(s.running) == ["a", "d", "b", "c"]
    # Every request now needs its second block, and none is free:
    #   a needs one -> victim max(a, d, b, c) = c (2, 3.0): c's block goes to a
    #   d needs one -> victim max(a, d, b) = b (2, 2.0): b's block goes to d
    out = step(s, w)
    assert ids(out.preempted) == ["c", "b"] and ids(out.scheduled) == ["a", "d"]
    assert s.num_preemptions == 2
    assert all(r.status is RequestStatus.PREEMPTED and r.num_computed_tokens == 0 for r in out.preempted)
    # Back in the heap by their keys: b (2, 2.0) before c (2, 3.0).
    assert ids(s.waiting) == ["b", "c"]


def test_fcfs_ignores_priority_admits_by_arrival_and_preempts_the_last_running():
    s, w = make("fcfs", 5)
    for rid, prio, t, i in (("a", 0, 1.0, 0), ("b", 2, 2.0, 1), ("c", 2, 3.0, 2), ("d", 1, 4.0, 3)):
        add(s, rid, 4, prio, t, i)
    assert type(s) is Scheduler
    assert ids(step(s, w).scheduled) == ["a", "b", "c", "d"]  # the order they came in
    out = step(s, w)
    # a pops d (the last running), b pops c.
    assert ids(out.preempted) == ["d", "c"] and ids(out.scheduled) == ["a", "b"]
    assert ids(s.waiting) == ["c", "d"]  # front of the queue, in running order


def test_equal_keys_preempt_the_first_found_in_running_order_as_vllms_max():
    # vLLM: max(running, key=(priority, arrival_time)) returns the first maximal one.
    s, w = make("priority", 3)
    add(s, "x", 4, 1, 5.0, 0)
    add(s, "y", 4, 1, 5.0, 1)
    assert ids(step(s, w).scheduled) == ["x", "y"]  # equal keys: by request_id
    out = step(s, w)  # both need a second block, none is free: x needs one -> victim x itself
    assert ids(out.preempted) == ["x"] and ids(out.scheduled) == ["y"]


def test_a_victim_scheduled_earlier_in_the_step_leaves_it_and_uncaches_its_new_block():
    # 5 usable blocks, caching on, budget 5, long-prefill cap 3 (applies once 2
    # requests are in). l (priority 5, a 20-token prompt) runs alone first.
    kv = KVCacheManager(6, BS, 64)
    s, w = PriorityScheduler(kv, 8, 5, 64, long_prefill_token_threshold=3), FakeWorker(6, BS)
    low = add(s, "l", 20, 5, 1.0, 0, max_tokens=1)  # 20 tokens in the cache: all 5 blocks
    step(s, w)  # alone, no cap: l computes 0..4            l: [L0* L1]
    high = add(s, "h", 4, 0, 2.0, 1)
    step(s, w)  # cap 3: l 5..7 (L1 fills); h 0..1          l: [L0 L1*]  h: [H0]
    step(s, w)  # l 8..10 (takes L2); h 2..3, samples        l: [L0 L1 L2]  h: [H0]; 1 block free
    l_blocks = list(kv.req_to_blocks["l"])
    # Step 4, running [l, h]:
    #   l: 11..13 fills L2 (cached at scheduling: L2*) and takes L3, the last free block
    #   h: token 4 needs H1; none free -> victim max(l (5, 1.0), h (0, 2.0)) = l, already
    #      scheduled: out of the step (its 3 tokens back to the budget); L2* loses its
    #      hash (token 11's KV is never written); L0 and L1 (computed) keep theirs
    out = s.schedule()
    assert ids(out.scheduled) == ["h"] and ids(out.preempted) == ["l"]
    assert out.num_scheduled_tokens == 1 and out.plan.num_scheduled_tokens == {}
    assert out.plan.preempted_seq_ids == [0] and [a.seq_id for a in out.plan.appended] == [1]
    l_blocks.append(kv.block_pool.blocks[out.plan.appended[0].block_ids[0]])  # h got one of l's freed blocks
    pool = kv.block_pool
    assert pool.get_cached_block(low.block_hashes[2]) is None
    assert [pool.get_cached_block(h) for h in low.block_hashes[:2]] == l_blocks[:2]
    assert low.status is RequestStatus.PREEMPTED and low in s.waiting
    kv.check_invariants()
    s.update_from_output(w.execute(out.plan))
    # l resumes on its prefix hits; had L2 kept its hash, l would read slot 11, never
    # written, and the fake worker would fail the step.
    while s.has_unfinished_requests():
        step(s, w)
    assert (low.num_output_tokens, high.num_output_tokens, low.num_preemptions) == (1, 5, 1)


def test_the_first_running_request_preempting_itself_does_not_idle_the_step():
    # vLLM runs an empty step here; kvpool plans again at once (None would idle the
    # engine loop until a wake-up).
    s, w = make("priority", 4)
    low = add(s, "l", 7, 5, 1.0, 0)
    step(s, w)  # l: 8 tokens, [L0 L1]
    add(s, "h", 4, 0, 2.0, 1)
    step(s, w)  # l fills L1; h admitted [H0]; l: 9 tokens, h: 5
    # Step 3: l needs a third block, none free -> victim max(l, h) = l itself: nothing
    # scheduled; planned again: h takes one of l's freed blocks.
    out = s.schedule()
    assert out is not None and ids(out.scheduled) == ["h"] and ids(out.preempted) == ["l"]
    assert out.plan.preempted_seq_ids == [0] and out.plan.appended == [AppendedBlocks(1, out.plan.appended[0].block_ids)]
    assert low in s.waiting


def test_a_waiting_request_never_preempts_a_running_one_whatever_its_priority():
    # As vLLM 0.32: only a running request that needs blocks preempts.
    s, w = make("priority", 4)
    low = add(s, "l", 4, 9, 1.0, 0, max_tokens=3)
    step(s, w)  # l: [L0], 5 tokens
    high = add(s, "h", 8, -9, 2.0, 1, max_tokens=2)
    for _ in range(2):
        # l takes L1 (1 block left free); h needs 2 for its 8 tokens: it waits
        out = step(s, w)
        assert ids(out.scheduled) == ["l"] and not out.preempted
    assert low.status is RequestStatus.FINISHED_LENGTH and s.num_preemptions == 0
    assert ids(step(s, w).scheduled) == ["h"] and high.status is RequestStatus.RUNNING


def test_the_policy_classes():
    assert scheduler_class("priority") is PriorityScheduler and PriorityScheduler.policy == "priority"
    assert scheduler_class("fcfs") is Scheduler and Scheduler.policy == "fcfs"
