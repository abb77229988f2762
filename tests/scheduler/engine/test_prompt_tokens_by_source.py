"""vllm:prompt_tokens_by_source against vLLM's invariant

    local_compute + local_cache_hit + external_kv_transfer == vllm:prompt_tokens

with prefix caching on and off (and a host tier): counted at each request's first
token from what its first admission found, as vLLM's PrefillStats. A known workload
by hand, random ones (small pools: preemptions; aborts) checked after every step, and
the real scheduler process."""

from __future__ import annotations

import random

import pytest
from kvtest.fake_worker import FakeWorker
from kvtest.scheduler_harness import BS, Setup, metric, prompt_of

from scheduler.core.hashing import BlockHasher
from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.core.offload.offload_tier import HostTier
from scheduler.engine.metrics import SchedulerMetrics
from scheduler.sched.request import Request, RequestStatus
from scheduler.sched.scheduler import Scheduler

LABELS = {"model_name": "m", "engine": "0"}
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


def by_source(m: SchedulerMetrics) -> dict[str, float]:
    get = m.registry.get_sample_value
    out = {s: get("vllm:prompt_tokens_by_source_total", {**LABELS, "source": s}) for s in SOURCES}
    out["total"] = get("vllm:prompt_tokens_total", LABELS)
    out["cached"] = get("vllm:prompt_tokens_cached_total", LABELS)
    out["device"] = get("vllm:prompt_tokens_cached_by_source_total", {**LABELS, "source": "device"})
    return out


@pytest.mark.parametrize("caching", [True, False])
def test_a_shared_prefix_by_hand(caching):
    kv = KVCacheManager(32, 4, 64, enable_caching=caching)
    sched, worker, m = Scheduler(kv, 8, 64, 64), FakeWorker(32, 4, 64), SchedulerMetrics("m")
    hasher = BlockHasher(4)
    prefix = [2, 3, 4, 5, 6, 7, 8, 9]
    sched.add_request(Request("a", prefix, 2, seq_id=0, block_hasher=hasher))  # 8 tokens
    sched.add_request(Request("b", [*prefix, 10, 11], 2, seq_id=1, block_hasher=hasher))  # the same 2 blocks, and 2 more
    while sched.has_unfinished_requests():
        m.observe_step(sched.update_from_output(worker.execute(sched.schedule().plan)), 0, 0.0)
        m.update(sched, kv)
    got = by_source(m)
    # b is admitted after a in the same step; a's blocks are cached when scheduled: b
    # hits both (8 tokens). Off, nothing hits: all 18 are computed.
    hits = 8 if caching else 0
    assert got == {"local_compute": 18 - hits, "local_cache_hit": hits, "external_kv_transfer": 0, "total": 18,
                   "cached": hits, "device": hits}
    get = m.registry.get_sample_value
    assert get("vllm:request_prefill_kv_computed_tokens_sum", LABELS) == 18 - hits
    assert get("vllm:iteration_tokens_total_sum", LABELS) == 18 - hits + 4  # 4 tokens out in all


def random_run(seed: int, caching: bool, num_host_blocks: int) -> SchedulerMetrics:
    rng = random.Random(seed)
    bs, num_blocks = 4, 12
    tier = HostTier(num_host_blocks, bs) if num_host_blocks else None
    kv = KVCacheManager(num_blocks, bs, 64, enable_caching=caching, host_tier=tier)
    sched = Scheduler(kv, 4, 16, 64, reserve_full_sequence=False)
    worker, m, hasher = FakeWorker(num_blocks, bs, 64, num_host_blocks=num_host_blocks), SchedulerMetrics("m"), BlockHasher(bs)
    prefixes = [[rng.randrange(2, 64) for _ in range(2 * bs)] for _ in range(2)]
    for i in range(30):
        prompt = rng.choice(prefixes) + [rng.randrange(2, 64) for _ in range(rng.randrange(1, 10))]
        sched.add_request(Request(f"r{i}", prompt, rng.randrange(1, 12), seq_id=i, block_hasher=hasher))
    for _ in range(2000):
        if not sched.has_unfinished_requests():
            return m
        if rng.random() < 0.05:
            sched.finish_requests([rng.choice(list(sched.requests))], RequestStatus.FINISHED_ABORTED)
        out = sched.schedule()
        if out is not None:
            m.observe_step(sched.update_from_output(worker.execute(out.plan)), 0, 0.0)
        m.update(sched, kv)
        got = by_source(m)
        assert got["local_compute"] + got["local_cache_hit"] + got["external_kv_transfer"] == got["total"], got
        assert got["local_cache_hit"] + got["external_kv_transfer"] == got["cached"], got
        assert got["local_compute"] >= 0
    raise AssertionError("workload did not drain")


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("caching,num_host_blocks", [(True, 0), (False, 0), (True, 6)])
def test_the_invariant_holds_after_every_step(seed, caching, num_host_blocks):
    m = random_run(seed, caching, num_host_blocks)
    got = by_source(m)
    assert got["total"] > 0
    get = m.registry.get_sample_value
    assert get("vllm:num_preemptions_total", LABELS) > 0  # the pool is tiny
    # Counted at admission, as vLLM's: the device's hits and the host tier's.
    assert got["device"] == get("vllm:prefix_cache_hits_total", LABELS)
    host = get("vllm:prompt_tokens_cached_by_source_total", {**LABELS, "source": "host"})
    assert host == (get("vllm:external_prefix_cache_hits_total", LABELS) if num_host_blocks else 0)
    if not caching:
        assert got["local_compute"] == got["total"] and got["cached"] == 0
    else:
        assert got["local_cache_hit"] > 0  # the shared prefixes hit


@pytest.mark.e2e
@pytest.mark.timeout(60)
@pytest.mark.parametrize("caching", [True, False])
def test_the_scheduler_process_counts_by_source(caching):
    s = Setup(*([] if caching else ["--no-enable-prefix-caching"]))
    try:
        prompt = prompt_of(7, 4 * BS + 2)  # 4 full blocks and 2 tokens
        s.client.generate("first", prompt, 3)
        s.client.generate("again", prompt, 3)  # finds the first one's 4 blocks, with caching
        m = s.wait_idle()
        hits = 4 * BS if caching else 0
        total = 2 * len(prompt)
        assert metric(m, "vllm:prompt_tokens_total") == total
        assert metric(m, "vllm:prompt_tokens_by_source_total", 'source="local_cache_hit"') == hits
        assert metric(m, "vllm:prompt_tokens_by_source_total", 'source="local_compute"') == total - hits
        assert metric(m, "vllm:prompt_tokens_by_source_total", 'source="external_kv_transfer"') == 0
        assert metric(m, "vllm:prompt_tokens_cached_total") == hits
        assert metric(m, "vllm:prompt_tokens_cached_by_source_total", 'source="device"') == hits
        assert metric(m, "vllm:request_prefill_kv_computed_tokens_sum") == total - hits
        assert metric(m, "vllm:request_queue_time_seconds_count") == 2
    finally:
        s.close()
