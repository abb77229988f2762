"""vLLM's WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR: a request with a grammar is not scheduled until the worker
says its grammar compiled; then it joins the waiting queue's back. The scheduler sends
each grammar once (again to a new worker), never compiles one, and forgets a request
ended while it waits. Orders in the comments are worked out by hand."""

from __future__ import annotations

import pytest
from kvtest.fake_worker import FakeWorker

from protocol.structured_output import GrammarSpec
from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.sched.priority_scheduler import PriorityScheduler
from scheduler.sched.request import Request, RequestStatus
from scheduler.sched.scheduler import Scheduler

BS, NUM_BLOCKS, EOS = 4, 101, 1
SPEC = GrammarSpec("regex", "[0-9]+")


def make(cls=Scheduler):
    kv = KVCacheManager(NUM_BLOCKS, BS, 64, enable_caching=False)
    return cls(kv, 4, 100, 64), FakeWorker(NUM_BLOCKS, BS)


def add(sched, rid: str, grammar=None) -> Request:
    r = Request(rid, [2 + i for i in range(8)], 5, seq_id=len(sched.requests) + 10 * ord(rid[0]), ignore_eos=True,
                eos_token_id=EOS, stop_token_ids=[7], grammar=grammar)
    sched.add_request(r)
    return r


def step(sched, worker) -> list[str]:
    out = sched.schedule()
    if out is None:
        return []
    sched.update_from_output(worker.execute(out.plan))
    return [r.request_id for r in out.scheduled]


@pytest.mark.parametrize("cls", [Scheduler, PriorityScheduler])
def test_a_grammar_request_waits_for_its_grammar(cls):
    s, w = make(cls)
    g = add(s, "g", SPEC)
    assert g.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR and s.num_waiting == 1
    assert s.take_grammar_compiles() == ([g.seq_id], [SPEC])
    assert s.take_grammar_compiles() == ([], [])  # sent once
    assert s.schedule() is None  # nothing else to run: it is not scheduled
    add(s, "p")
    assert step(s, w) == ["p"]  # a plain request overtakes it
    assert s.grammars_ready([g.seq_id, 12345]) == 1  # an unknown id is skipped
    assert g.status == RequestStatus.WAITING
    assert step(s, w) == ["p", "g"]  # it joined the back of the queue


def test_the_row_carries_the_grammar_and_every_stop_id():
    s, w = make()
    g = add(s, "g", SPEC)
    s.grammars_ready([g.seq_id])
    out = s.schedule()
    (row,) = out.plan.new_rows
    # vLLM's matcher stops on all_stop_token_ids: the request's and EOS, even with ignore_eos.
    assert row.sampling.grammar.spec == SPEC and row.sampling.grammar.stop_token_ids == [EOS, 7]
    assert row.sampling.params.is_greedy


def test_ended_while_waiting_and_a_new_worker():
    s, _ = make()
    g, h = add(s, "g", SPEC), add(s, "h", SPEC)
    s.take_grammar_compiles()
    assert [r.request_id for r in s.finish_requests(["g"], RequestStatus.FINISHED_ABORTED)] == ["g"]
    assert s.num_waiting == 1 and "g" not in s.requests
    assert s.grammars_ready([g.seq_id]) == 0  # ended: not queued
    s.recompile_grammars()  # a new worker holds no grammar: h asks again
    assert s.take_grammar_compiles() == ([h.seq_id], [SPEC])
    assert s.grammar_failures([g.seq_id, h.seq_id], ["gone", "bad"]) == [("h", "bad")]
