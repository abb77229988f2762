"""SchedulerMetrics.observe_step: the latency histograms it fills equal what one
Histogram.observe per token would give; the pool's and the prefix cache's counters."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram

from scheduler.engine.metrics import SchedulerMetrics
from scheduler.engine.request_metrics import observe_repeated
from scheduler.sched.outputs import StepTokens
from scheduler.sched.request import Request

# vLLM 0.32's TIME_TO_FIRST_TOKEN_BUCKETS (vllm/v1/metrics/buckets.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0, 160.0, 640.0, 2560.0)


def samples(registry: CollectorRegistry, name: str) -> dict[tuple[str, str], float]:
    """(sample name, le) -> value, for one histogram; _created left out."""
    out = {}
    for family in registry.collect():
        if family.name == name:
            for s in family.samples:
                if not s.name.endswith("_created"):
                    out[(s.name, s.labels.get("le", ""))] = s.value
    return out


@pytest.mark.parametrize("value", [0.0, 0.001, 0.0010001, 0.01, 0.0375, 0.04, 79.9, 80.0, 80.1, 1e9])
def test_observe_repeated_is_observe_count_times(value):
    one, many = CollectorRegistry(), CollectorRegistry()
    h1 = Histogram("h", "h", buckets=TTFT_BUCKETS, registry=one)
    h2 = Histogram("h", "h", buckets=TTFT_BUCKETS, registry=many)
    for _ in range(7):
        h1.observe(value)
    observe_repeated(h2, value, 7)
    a, b = samples(one, "h"), samples(many, "h")
    assert a.keys() == b.keys()
    for key in a:
        assert b[key] == pytest.approx(a[key], rel=1e-12), key


def test_observe_step_matches_one_observe_per_token():
    fast, ref = SchedulerMetrics("m"), SchedulerMetrics("m")
    reqs = [Request(f"r{i}", [2, 3], 5, arrival_time=90.0 + i) for i in range(9)]
    for r in reqs:  # admitted, nothing cached; those that end got their first token at 95
        r.scheduled_time, r.num_cached_tokens, r.first_token_time, r.last_token_time = 91.0 + r.seq_id, 0, 95.0, 100.0
    now = 100.0
    # Three first tokens (TTFT), gaps from two earlier steps and one odd one, and two
    # requests that finished.
    prev = [None, 99.99, 99.99, None, 99.5, 99.99, 97.0, None, 99.5]
    outputs = StepTokens(now, reqs, [7] * 9, prev, {2: "stop", 6: "length"})
    fast.observe_step(outputs, 11, 0.002)
    for r, p in zip(reqs, prev, strict=True):
        if p is None:
            ref.request_metrics.ttft.observe(now - r.arrival_time)
        else:
            ref.request_metrics.itl.observe(now - p)
    for i in (2, 6):
        ref.request_metrics.e2e.observe(now - reqs[i].arrival_time)
    for name in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds"):
        got, want = samples(fast.registry, name), samples(ref.registry, name)
        assert got.keys() == want.keys() and got
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-12), (name, key)
    assert samples(fast.registry, "vllm:time_to_first_token_seconds")[("vllm:time_to_first_token_seconds_count", "")] == 3
    assert samples(fast.registry, "vllm:inter_token_latency_seconds")[("vllm:inter_token_latency_seconds_count", "")] == 6


LABELS = {"model_name": "m", "engine": "0"}


def pool_and_policy(num_blocks: int = 16, block_size: int = 4):
    from scheduler.core.kv_cache_manager import KVCacheManager
    from scheduler.sched.scheduler import Scheduler

    kv = KVCacheManager(num_blocks, block_size, 64)
    return kv, Scheduler(kv, 8, 64, 64)


def test_prefix_cache_counters_count_first_admissions_and_preempted_apart():
    kv, sched = pool_and_policy()
    m = SchedulerMetrics("m")
    kv.record_prefix_cache_query(10, 8, preempted=False)
    kv.record_prefix_cache_query(10, 8, preempted=True)
    kv.record_prefix_cache_query(6, 4, preempted=True)
    m.update(sched, kv)
    value = m.registry.get_sample_value
    assert value("vllm:prefix_cache_queries_total", LABELS) == 10
    assert value("vllm:prefix_cache_hits_total", LABELS) == 8
    assert value("kvpool_prefix_cache_preempted_queries_total", LABELS) == 16
    assert value("kvpool_prefix_cache_preempted_hits_total", LABELS) == 12


@pytest.mark.parametrize("seed", range(3))
def test_observe_many_is_one_observe_per_value(seed):
    import random

    from scheduler.core.block_residency import RESIDENCY_BUCKETS
    from scheduler.engine.request_metrics import observe_many

    rng = random.Random(seed)
    values = [rng.choice(RESIDENCY_BUCKETS) for _ in range(20)] + [rng.uniform(0, 2000) for _ in range(50)] + [0.0, 5000.0]
    one, many = CollectorRegistry(), CollectorRegistry()
    h1 = Histogram("h", "h", buckets=RESIDENCY_BUCKETS, registry=one)
    h2 = Histogram("h", "h", buckets=RESIDENCY_BUCKETS, registry=many)
    for v in values:
        h1.observe(v)
    observe_many(h2, values)
    a, b = samples(one, "h"), samples(many, "h")
    assert a.keys() == b.keys()
    for key in a:
        assert b[key] == pytest.approx(a[key], rel=1e-12), key


def test_residency_histograms_exist_only_with_kv_cache_metrics():
    from scheduler.core.block_residency import residency_pool_factory
    from scheduler.core.kv_cache_manager import KVCacheManager
    from scheduler.sched.scheduler import Scheduler

    clock = iter([0.0, 3.0]).__next__  # read once per get_new_blocks
    kv = KVCacheManager(4, 4, 64, pool_factory=lambda n, c, s: residency_pool_factory()(n, c, s, clock=clock))
    sched = Scheduler(kv, 8, 64, 64)
    pool = kv.block_pool
    blocks = pool.get_new_blocks(3)  # t=0
    pool.free_blocks(blocks)
    pool.get_new_blocks(3)  # t=3: three tenancies of 3 s end
    on, off = SchedulerMetrics("m", kv_cache_metrics=True), SchedulerMetrics("m")
    on.update(sched, kv)
    value = on.registry.get_sample_value
    assert value("vllm:kv_block_lifetime_seconds_count", LABELS) == 3
    assert value("vllm:kv_block_lifetime_seconds_sum", LABELS) == 9.0
    assert value("vllm:kv_block_lifetime_seconds_bucket", dict(LABELS, le="2.0")) == 0
    assert value("vllm:kv_block_lifetime_seconds_bucket", dict(LABELS, le="5.0")) == 3
    assert value("vllm:kv_block_idle_before_evict_seconds_count", LABELS) == 3
    assert value("vllm:kv_block_reuse_gap_seconds_count", LABELS) == 0
    off.update(sched, kv)
    assert b"kv_block_lifetime" not in off.render()


def test_peak_and_token_usage_gauges():
    from scheduler.core.hashing import BlockHasher
    from scheduler.sched.request import Request

    kv, sched = pool_and_policy(num_blocks=11, block_size=4)  # 10 usable blocks, 40 token slots
    hasher = BlockHasher(4)
    sched.add_request(Request("a", list(range(2, 8)), 4, seq_id=0, block_hasher=hasher))  # 6 tokens: 2 blocks
    sched.add_request(Request("b", list(range(2, 11)), 4, seq_id=1, block_hasher=hasher))  # 9 tokens, 1 hit: 3 blocks
    sched.schedule()
    m = SchedulerMetrics("m")
    m.update_waiting_gauges(sched)
    m.update_step_gauges(sched, kv)
    m.update(sched, kv)
    value = m.registry.get_sample_value
    # Held: "a" 2 blocks, "b" 1 shared + 2 own = 4 blocks; filled: 6 + 9 - 4 shared = 11 tokens.
    assert value("vllm:kv_cache_usage_perc", LABELS) == pytest.approx(0.4)
    assert value("kvpool_kv_cache_token_usage_perc", LABELS) == pytest.approx(11 / 40)
    assert value("kvpool_peak_kv_cache_usage_perc", LABELS) == pytest.approx(0.4)
    for request in list(sched.running):
        kv.free(request)
    sched.running.clear()
    m.update(sched, kv)
    assert value("vllm:kv_cache_usage_perc", LABELS) == pytest.approx(0.4)  # NOTE: a step's gauge: read once a step
    m.update_step_gauges(sched, kv)
    assert value("vllm:kv_cache_usage_perc", LABELS) == 0.0
    assert value("kvpool_kv_cache_token_usage_perc", LABELS) == 0.0
    assert value("kvpool_peak_kv_cache_usage_perc", LABELS) == pytest.approx(0.4)
