"""The simulator's predictions under --kv-eviction-policy equal the live service's
/metrics on the same small workload, run one request at a time (as the host tier's
test_offload_live.py does): prefix-cache queries, hits and evictions. The workload
is worked by hand for lru and lfu, so both sides are also held to those figures.

Block size 4, 7 blocks (6 usable), one output token: a request of 12 tokens holds
3 blocks, all full and cached. PA, PB, PC are 2-block prefixes, s1.. 1-block suffixes.

    r0 PA+s1: a0 a1 x1 cached       r1 PA+s2: hits a0 a1 (8 tokens), x2 new
    r2 PB+s3: 3 new, evicts x1     r3 PC+s4: 3 new, evicts 3
    r4 PA+s5: lru evicted a0 a1 in r3 (least recently freed): no hit; lfu kept them
    (hit once, every other block never): 8 more hit tokens.
"""

from __future__ import annotations

import time

import pytest
from kvtest.cluster import Cluster

from loadgen.datasets import SampleRequest
from protocol.client_messages import Generate
from simulator.config import SimConfig
from simulator.replay import simulate
from simulator.workload import SampleWorkload

pytestmark = pytest.mark.e2e

BS, NUM_BLOCKS = 4, 7
PA, PB, PC = list(range(10, 18)), list(range(40, 48)), list(range(60, 68))
PROMPTS = [PA + [1, 1, 1, 1], PA + [2, 2, 2, 2], PB + [3, 3, 3, 3], PC + [4, 4, 4, 4], PA + [5, 5, 5, 5]]
HAND = {"lru": 8, "lfu": 16}  # hit tokens


def predicted(policy: str):
    workload = SampleWorkload([SampleRequest(p, 1) for p in PROMPTS], [100.0 * i for i in range(len(PROMPTS))], 512)
    return simulate(workload, SimConfig(num_blocks=NUM_BLOCKS, block_size=BS, max_num_seqs=1, max_model_len=4096, eviction_policy=policy))


def settled(cluster: Cluster, name: str, value: float, timeout: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        samples = cluster.metrics()
        if samples.get(name) == value or time.monotonic() > deadline:
            return samples
        time.sleep(0.1)


@pytest.mark.parametrize("policy", ["lru", "lfu", "cost", "arc", "s3fifo"])
def test_predicted_counters_equal_the_live_metrics(policy):
    sim = predicted(policy)
    assert sim.num_finished == len(PROMPTS) and sim.prefix_cache_queries == 60
    if policy in HAND:
        assert sim.prefix_cache_hits == HAND[policy]
    scheduler_args = ["--block-size", str(BS), "--num-gpu-blocks-override", str(NUM_BLOCKS), "--max-num-seqs", "1", "--kv-eviction-policy", policy]
    worker_args = ["--block-size", str(BS), "--dtype", "float32", "--kv-cache-memory", "1MiB"]
    with Cluster(scheduler_args, worker_args) as cluster:
        for i, prompt in enumerate(PROMPTS):  # one at a time: each ends before the next starts
            result = cluster.generate([Generate(f"r{i}", prompt, max_tokens=1, ignore_eos=True)], timeout=60)[f"r{i}"]
            assert result.error is None
        live = settled(cluster, "vllm:prefix_cache_queries_total", sim.prefix_cache_queries)
    assert live["vllm:prefix_cache_queries_total"] == sim.prefix_cache_queries
    assert live["vllm:prefix_cache_hits_total"] == sim.prefix_cache_hits
    assert live["kvpool_evictions_total"] == sim.num_evictions
