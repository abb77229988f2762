"""vllm:kv_cache_usage_perc, vllm:num_requests_running and vllm:num_requests_waiting are a
step's, as vLLM's (its SchedulerStats, made in update_from_output): usage and running
once the step's result is applied (its finished requests freed), waiting as the
schedule left it (vLLM's engine takes new requests in only before its next schedule). A
scrape in between reads the last step's values, not the live pool (issue #45: read live,
kvpool's sampled peak stood above any state vLLM reports, and requests that arrived
during a step read as waiting).

The pool: a hybrid one, a sliding group of 8 tokens and a full one, blocks of 4, 20
usable (vLLM's usage: 1 - free / (num_gpu_blocks - 1)).
"""

from __future__ import annotations

import pytest

from protocol.worker_messages import StepResult
from scheduler.core.hashing import BlockHasher
from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.engine.metrics import SchedulerMetrics
from scheduler.sched.request import Request
from scheduler.sched.scheduler import Scheduler

LABELS = {"model_name": "m", "engine": "0"}
BS = 4


def gauge(m: SchedulerMetrics, name: str) -> float:
    return m.registry.get_sample_value(name, LABELS)


def request(rid: str, seq_id: int, prompt: list[int], max_tokens: int) -> Request:
    return Request(rid, prompt, max_tokens, seq_id=seq_id, ignore_eos=True, eos_token_id=1, block_hasher=BlockHasher(BS))


def test_the_gauges_are_the_steps_not_the_live_pools():
    kv = KVCacheManager(21, BS, 64, group_windows=[8, 0], max_num_batched_tokens=64)
    sched = Scheduler(kv, 8, 64, 64)
    m = SchedulerMetrics("m")
    sched.add_request(request("a", 0, list(range(10, 22)), max_tokens=1))  # 12 tokens: 3 blocks a group
    sched.add_request(request("b", 1, list(range(30, 40)), max_tokens=4))  # 10 tokens: 3 blocks a group
    out = sched.schedule()
    m.update_waiting_gauges(sched)
    # head -> ... : a and b hold 6 blocks each (no window has passed a block yet)
    assert kv.usage == pytest.approx(12 / 20)
    sched.add_request(request("c", 2, list(range(50, 58)), max_tokens=2))  # arrives while the step runs
    m.update(sched, kv)  # a scrape now
    assert gauge(m, "vllm:kv_cache_usage_perc") == 0.0  # no step has ended yet
    assert gauge(m, "vllm:num_requests_waiting") == 0.0  # c has not met a schedule
    sched.update_from_output(StepResult(out.plan.step_id, [0, 1], [7, 8]))  # a's one token: a finished, freed
    m.update_step_gauges(sched, kv)
    assert gauge(m, "vllm:kv_cache_usage_perc") == pytest.approx(6 / 20)  # b's 3 blocks in each group
    assert gauge(m, "vllm:num_requests_running") == 1.0
    assert gauge(m, "vllm:num_requests_waiting") == 0.0
    out = sched.schedule()  # b decodes in its blocks (11 tokens < 12); c's 8 tokens: 2 blocks a group
    m.update_waiting_gauges(sched)
    m.update(sched, kv)
    assert kv.usage == pytest.approx(10 / 20)
    assert gauge(m, "vllm:kv_cache_usage_perc") == pytest.approx(6 / 20)  # still the last step's
    assert gauge(m, "vllm:num_requests_waiting") == 0.0
    sched.update_from_output(StepResult(out.plan.step_id, [1, 2], [9, 9]))
    m.update_step_gauges(sched, kv)
    assert gauge(m, "vllm:kv_cache_usage_perc") == pytest.approx(10 / 20)
    assert gauge(m, "vllm:num_requests_running") == 2.0


def test_a_request_the_schedule_leaves_waiting_counts():
    # 20 usable blocks; a's 40 tokens take 10 a group: b (12 tokens, 3 a group) does not fit.
    kv = KVCacheManager(21, BS, 64, group_windows=[8, 0], max_num_batched_tokens=64)
    sched = Scheduler(kv, 8, 64, 64)
    m = SchedulerMetrics("m")
    sched.add_request(request("a", 0, list(range(10, 50)), max_tokens=4))
    sched.add_request(request("b", 1, list(range(60, 72)), max_tokens=4))
    sched.schedule()
    m.update_waiting_gauges(sched)
    assert [r.request_id for r in sched.running] == ["a"]
    assert gauge(m, "vllm:num_requests_waiting") == 1.0
    assert m.registry.get_sample_value("vllm:num_requests_waiting_by_reason", LABELS | {"reason": "capacity"}) == 1.0
