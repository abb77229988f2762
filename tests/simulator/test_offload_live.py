"""The simulator's predictions with a host tier equal the live service's /metrics on
the same small workload, run one request at a time, storing on eviction and
write-through: the scheduler's hit counters by tier and its store/load counts, and
the worker's bytes moved. The workload is the
hand-worked one of test_offload_sim.py (A, B, then A's prefix again), so both sides
are also held to figures worked out by hand."""

from __future__ import annotations

import time

import pytest
from kvtest.cluster import Cluster, free_port
from kvtest.hf_models import reference_generate

from protocol.client_messages import Generate
from simulator.config import SimConfig
from simulator.replay import simulate
from simulator.workload import SampleWorkload

pytestmark = pytest.mark.e2e

BS, NUM_BLOCKS, OUTPUT_LEN = 4, 7, 2
# The tiny checkpoint in float64: 2 x 4 layers x 2 KV heads x 32 dims x 8 bytes a
# token; 1/1024 GiB of host memory holds 64 blocks of 4 tokens.
KV_BYTES_PER_TOKEN, HOST_GIB, HOST_BLOCKS = 4096, 1 / 1024, 64
PREFIX_A, PREFIX_B = list(range(10, 26)), list(range(40, 56))
PROMPTS = [PREFIX_A + [1, 2, 3, 4], PREFIX_B + [5, 6, 7, 8], PREFIX_A + [9, 9, 9, 9]]


def predicted(store: str):
    from loadgen.datasets import SampleRequest

    workload = SampleWorkload([SampleRequest(p, OUTPUT_LEN) for p in PROMPTS], [100.0 * i for i in range(len(PROMPTS))], 512)
    cfg = SimConfig(num_blocks=NUM_BLOCKS, block_size=BS, max_num_seqs=1, max_model_len=4096,
                    num_host_blocks=HOST_BLOCKS, kv_bytes_per_token=KV_BYTES_PER_TOKEN, offload_store=store)
    return simulate(workload, cfg)


def wait_for(cluster: Cluster, name: str, value: float, port: int | None = None, timeout: float = 10.0) -> dict[str, float]:
    """The /metrics samples once ``name`` reads ``value`` (metrics update between steps)."""
    deadline = time.monotonic() + timeout
    while True:
        text = cluster.metrics_text(port)
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, v = line.rpartition(" ")
                samples[key.split("{", 1)[0]] = float(v)
        if samples.get(name) == value or time.monotonic() > deadline:
            return samples
        time.sleep(0.1)


# Stores and skipped stores by hand: on eviction, A's 5 hashed blocks when B needs the
# device, B's 5 when the third request does; write-through, every full block once
# computed (5, 5 and the third request's suffix block), its 4 loaded blocks skipped.
@pytest.mark.parametrize(("store", "num_stores", "num_skipped"), [("eviction", 10, 0), ("full", 11, 4)])
def test_predicted_hit_rates_by_tier_equal_the_live_metrics(tiny_reference, store: str, num_stores: int, num_skipped: int):
    sim = predicted(store)
    worker_port = free_port()
    scheduler_args = ["--block-size", str(BS), "--num-gpu-blocks-override", str(NUM_BLOCKS), "--max-num-seqs", "1",
                      "--kv-offloading-size", str(HOST_GIB), "--kv-offloading-store", store]
    worker_args = ["--block-size", str(BS), "--dtype", "float64", "--kv-cache-memory", "1MiB",
                   "--kv-offloading-size", str(HOST_GIB), "--http-port", str(worker_port)]
    with Cluster(scheduler_args, worker_args) as cluster:
        outputs = []
        for i, prompt in enumerate(PROMPTS):  # one at a time: each ends before the next starts
            result = cluster.generate([Generate(f"r{i}", prompt, max_tokens=OUTPUT_LEN, ignore_eos=True)], timeout=60)[f"r{i}"]
            assert result.error is None and result.finish_reason == "length"
            outputs.append(result.token_ids)
        live = wait_for(cluster, "vllm:external_prefix_cache_queries_total", sim.external_prefix_cache_queries)
        worker = wait_for(cluster, "vllm:kv_offload_load_bytes_total", sim.bytes_loaded, port=worker_port)
    # Both sides against the figures worked out by hand (test_offload_sim.py).
    assert (sim.prefix_cache_queries, sim.prefix_cache_hits, sim.external_prefix_cache_queries, sim.external_prefix_cache_hits) == (60, 0, 60, 16)
    assert (sim.num_host_stores, sim.num_host_stores_skipped, sim.num_host_loads) == (num_stores, num_skipped, 4)
    assert live["vllm:prefix_cache_queries_total"] == sim.prefix_cache_queries
    assert live["vllm:prefix_cache_hits_total"] == sim.prefix_cache_hits
    assert live["vllm:external_prefix_cache_queries_total"] == sim.external_prefix_cache_queries
    assert live["vllm:external_prefix_cache_hits_total"] == sim.external_prefix_cache_hits
    assert live["kvpool_kv_offload_stored_blocks_total"] == sim.num_host_stores
    assert live["kvpool_kv_offload_loaded_blocks_total"] == sim.num_host_loads
    assert live["kvpool_kv_offload_stores_skipped_total"] == sim.num_host_stores_skipped
    assert live["kvpool_kv_offload_evictions_total"] == sim.num_host_evictions == 0
    assert worker["vllm:kv_offload_store_bytes_total"] == sim.bytes_stored == num_stores * BS * KV_BYTES_PER_TOKEN
    assert worker["vllm:kv_offload_load_bytes_total"] == sim.bytes_loaded == 4 * BS * KV_BYTES_PER_TOKEN
    # And the request whose prefix came from the host tier samples what transformers does.
    assert outputs == [reference_generate(tiny_reference, p, OUTPUT_LEN) for p in PROMPTS]
