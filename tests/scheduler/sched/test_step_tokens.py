"""Scheduler.update_from_output's StepTokens: the columns, the latencies read from
them, and requests that end while their step is in flight."""

from __future__ import annotations

from protocol.worker_messages import StepResult
from scheduler.core.hashing import BlockHasher
from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.sched.request import Request, RequestStatus
from scheduler.sched.scheduler import Scheduler

BS = 4


def make(num_requests: int, max_tokens: list[int]) -> Scheduler:
    sched = Scheduler(KVCacheManager(64, BS, 256), 8, 256, 256)
    hasher = BlockHasher(BS)
    for i in range(num_requests):
        prompt = [2 + i, 3, 4, 5, 6]
        sched.add_request(Request(f"r{i}", prompt, max_tokens[i], seq_id=10 + i, eos_token_id=1,
                                  block_hasher=hasher, arrival_time=100.0 + i))
    return sched


def step(sched: Scheduler, tokens: dict[int, int]):
    out = sched.schedule()
    ids = [r.seq_id for r in out.sampling]
    return sched.update_from_output(StepResult(out.plan.step_id, ids, [tokens.get(s, 7) for s in ids]))


def test_columns_rows_and_latencies():
    sched = make(3, [5, 5, 2])
    first = step(sched, {})
    assert [r.request_id for r in first.requests] == ["r0", "r1", "r2"]
    assert first.token_ids == [7, 7, 7]
    assert first.prev_token_times == [None, None, None]  # first tokens: TTFT, no ITL
    assert [first.ttft_s(i) for i in range(3)] == [first.time - 100.0, first.time - 101.0, first.time - 102.0]
    assert first.finish_reasons == {}

    # r1 samples EOS (stop), r2 reaches max_tokens (length), r0 goes on.
    second = step(sched, {11: 1})
    assert second.token_ids == [7, 1, 7]
    assert second.prev_token_times == [first.time] * 3
    assert second.finish_reasons == {1: "stop", 2: "length"}
    assert [second.ttft_s(i) for i in range(3)] == [None] * 3  # not first tokens: ITL, no TTFT
    assert [r.request_id for r in sched.running] == ["r0"]
    assert sched.num_generation_tokens == 6
    assert sched.requests["r0"].output_token_ids == [7, 7]


def test_a_request_aborted_in_flight_is_left_out_and_the_rest_stay_aligned():
    sched = make(4, [3, 3, 3, 1])
    step(sched, {})  # r3 ends (max_tokens 1)
    out = sched.schedule()
    assert [r.request_id for r in out.sampling] == ["r0", "r1", "r2"]
    # The worker runs the step; meanwhile the client aborts r1.
    (aborted,) = sched.finish_requests(["r1"], RequestStatus.FINISHED_ABORTED)
    outputs = sched.update_from_output(StepResult(out.plan.step_id, [10, 11, 12], [7, 8, 1]))
    assert [r.request_id for r in outputs.requests] == ["r0", "r2"]
    assert outputs.token_ids == [7, 1] and len(outputs.prev_token_times) == 2
    assert outputs.finish_reasons == {1: "stop"}  # r2 sampled EOS; its index moved
    assert aborted.output_token_ids == [7]  # the in-flight token was not appended
    assert [r.request_id for r in sched.running] == ["r0"]
