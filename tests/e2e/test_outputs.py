"""End to end, real processes over loopback: greedy outputs of the default (tiny
generated) checkpoint through the paged KV cache equal transformers' generate of the
same checkpoint, with prefix caching on and off, with a pool small enough to preempt
and a budget small enough to chunk prefills.

The worker runs in float64 so that no near-tie can flip a greedy token between
differently-chunked computations.
"""

from __future__ import annotations

import random

import pytest
from kvtest.cluster import Cluster
from kvtest.hf_models import reference_generate

from protocol.client_messages import Generate

pytestmark = pytest.mark.e2e

BLOCK = 16


def mixed_workload(seed: int = 7, n: int = 14) -> list[Generate]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(2, 512) for _ in range(k * BLOCK)] for k in (2, 3)]
    reqs = []
    for i in range(n):
        prefix = prefixes[i % 2] if i % 5 != 4 else []
        suffix = [rng.randrange(2, 512) for _ in range(rng.randrange(1, 40))]
        reqs.append(Generate(f"req-{i}", prefix + suffix, max_tokens=rng.randrange(4, 20), ignore_eos=i % 3 != 0))
    return reqs


@pytest.fixture(scope="module")
def reference_outputs(tiny_reference):
    return {g.request_id: reference_generate(tiny_reference, g.prompt_token_ids, g.max_tokens, g.ignore_eos) for g in mixed_workload()}


CONFIGS = {
    "caching-on": [],
    "caching-off": ["--no-enable-prefix-caching"],
    # 24 blocks (23 usable) for 14 requests of up to 6 blocks each: preemptions.
    "small-pool": ["--num-gpu-blocks-override", "24"],
    # A 24-token budget splits every longer prompt over several steps.
    "small-budget": ["--max-num-batched-tokens", "24"],
    "small-pool-small-budget-no-caching": ["--num-gpu-blocks-override", "24", "--max-num-batched-tokens", "24", "--no-enable-prefix-caching"],
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_outputs_equal_the_reference(name, reference_outputs, tmp_path):
    workload = mixed_workload()
    with Cluster(CONFIGS[name], ["--dtype", "float64"], log_dir=tmp_path) as c:
        results = c.generate(workload)
        m = c.metrics()
    for g in workload:
        r = results[g.request_id]
        assert r.error is None, r.error
        assert r.token_ids == reference_outputs[g.request_id], g.request_id
        assert r.finish_reason in ("length", "stop")
    if "small-pool" in name:
        assert m["vllm:num_preemptions_total"] > 0
    if name == "caching-on":
        assert m["vllm:prefix_cache_hits_total"] > 0
    if "no-caching" in name or name == "caching-off":
        assert m["vllm:prefix_cache_hits_total"] == 0
    assert m["vllm:kv_cache_usage_perc"] == 0.0


def test_drained_pool_holds_nothing_and_counters_match_the_shared_prefixes(tmp_path):
    rng = random.Random(3)
    prefixes = [[rng.randrange(2, 512) for _ in range(3 * BLOCK)], [rng.randrange(2, 512) for _ in range(2 * BLOCK)]]
    workload = []
    for i in range(8):
        workload.append(Generate(f"s{i}", prefixes[i % 2] + [rng.randrange(2, 512) for _ in range(10)], max_tokens=4, ignore_eos=True))
    with Cluster([], log_dir=tmp_path) as c:
        sock = c.client()
        try:
            results = {}
            for g in workload:  # one at a time, so the expected hits are exact
                results.update(c.generate([g], sock=sock))
        finally:
            sock.close(linger=0)
        m = c.metrics()
    # The first request of each prefix misses; every later one hits the whole prefix.
    expected_hits = sum(len(prefixes[i % 2]) for i in range(2, 8))
    assert [results[g.request_id].num_cached_tokens for g in workload] == [0, 0] + [len(prefixes[i % 2]) for i in range(2, 8)]
    assert m["vllm:prefix_cache_queries_total"] == sum(len(g.prompt_token_ids) for g in workload)
    assert m["vllm:prefix_cache_hits_total"] == expected_hits
    assert m["vllm:kv_cache_usage_perc"] == 0.0
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
    # Freed blocks keep their hashes: the cache is warm although usage reads 0.
    assert m["kvpool_free_cached_blocks"] > 0


def test_two_identical_prompts_sent_at_the_same_moment(tmp_path):
    prompt = list(range(10, 10 + 3 * BLOCK + 5))
    with Cluster([], log_dir=tmp_path) as c:
        results = c.generate([Generate("twin-a", prompt, 12, ignore_eos=True), Generate("twin-b", prompt, 12, ignore_eos=True)])
        assert c.metrics()["vllm:kv_cache_usage_perc"] == 0.0
    a, b = results["twin-a"], results["twin-b"]
    assert a.finish_reason == b.finish_reason == "length"
    assert a.token_ids == b.token_ids and len(a.token_ids) == 12
