"""vLLM 0.32's admission gate (``scheduler_reserve_full_isl``, on by default): a waiting
request is admitted only if the free blocks could hold its whole sequence, not only the
chunk it is scheduled for. Block size 4 throughout."""

from __future__ import annotations

from kvtest.kv_manager import BS, admit, manager, req, snapshot

from protocol.worker_messages import StepResult
from scheduler.core.hashing import BlockHasher
from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.engine.args import config_from_args
from scheduler.sched.request import Request, RequestStatus
from scheduler.sched.scheduler import Scheduler

PREFIX = list(range(10, 26))  # 16 tokens: 4 full blocks


def test_the_gate_counts_evictable_hits_against_the_free_blocks():
    m = manager(num_blocks=9, max_model_len=64)  # 8 usable blocks
    r0 = req("r0", PREFIX)
    admit(m, r0)
    m.free(r0)  # its 4 blocks stay cached, evictable: 8 free, 4 of them the hits below
    r1 = req("r1", PREFIX + list(range(40, 60)))  # 36 tokens: 9 blocks, 4 of them hits
    hits, n = m.get_computed_blocks(r1)
    assert len(hits) == 4 and n == 16
    before = snapshot(m)
    # A 4-token chunk needs 1 new block of the 8 - 4 free ones, but the whole sequence
    # needs 5: refused, and nothing changed.
    assert m.allocate_slots(r1, 4, n, hits, full_sequence_must_fit=True) is None
    assert snapshot(m) == before
    # 32 tokens (8 blocks) need 4 more: they fit, gate or not.
    r2 = req("r2", PREFIX + list(range(40, 56)))
    hits2, n2 = m.get_computed_blocks(r2)
    new = m.allocate_slots(r2, 4, n2, hits2, full_sequence_must_fit=True)
    assert new is not None and len(new) == 1
    m.check_invariants()


def test_without_the_gate_the_first_chunk_is_enough():
    m = manager(num_blocks=9, max_model_len=64)
    r0 = req("r0", PREFIX)
    admit(m, r0)
    m.free(r0)
    r1 = req("r1", PREFIX + list(range(40, 60)))
    hits, n = m.get_computed_blocks(r1)
    new = m.allocate_slots(r1, 4, n, hits)
    assert new is not None and len(new) == 1


def step(sched: Scheduler):
    """One step; every request that completed its tokens samples token 99."""
    out = sched.schedule()
    done = [r.seq_id for r in out.scheduled if r.num_computed_tokens == r.num_tokens]
    sched.update_from_output(StepResult(out.plan.step_id, done, [99] * len(done)))
    return out


def two_requests(reserve: bool) -> tuple[Scheduler, Request, Request]:
    # 6 usable blocks, 8 tokens a step. A (8 tokens, 4 to generate: 3 blocks at most)
    # takes the first step whole; B (24 tokens: 6 blocks) waits.
    hasher = BlockHasher(BS)
    sched = Scheduler(KVCacheManager(7, BS, 64), 4, 8, 64, reserve_full_sequence=reserve)
    a = Request("a", list(range(10, 18)), 4, seq_id=0, ignore_eos=True, block_hasher=hasher)
    b = Request("b", list(range(30, 54)), 4, seq_id=1, ignore_eos=True, block_hasher=hasher)
    sched.add_request(a)
    sched.add_request(b)
    assert [r.request_id for r in step(sched).scheduled] == ["a"]
    return sched, a, b


def test_a_request_whose_whole_prompt_does_not_fit_waits():
    sched, a, b = two_requests(reserve=True)
    # Step 2: A decodes into a third block (3 left). B's 7-token chunk would fit in 2,
    # but its 24 tokens need 6: it waits, and nothing is preempted.
    out = step(sched)
    assert [r.request_id for r in out.scheduled] == ["a"]
    assert b.status == RequestStatus.WAITING and sched.num_preemptions == 0
    # Once A is done its blocks are free again and B is admitted.
    while not a.status.is_finished:
        step(sched)
    assert "b" in [r.request_id for r in step(sched).scheduled]
    assert sched.num_preemptions == 0


def test_with_the_gate_off_the_first_chunk_is_admitted():
    sched, _, b = two_requests(reserve=False)
    out = step(sched)
    assert [r.request_id for r in out.scheduled] == ["a", "b"]
    assert out.plan.num_scheduled_tokens[b.seq_id] == 7


def test_the_flag_reaches_the_scheduler_config():
    assert config_from_args([]).scheduler_reserve_full_isl is True
    assert config_from_args(["--no-scheduler-reserve-full-isl"]).scheduler_reserve_full_isl is False
