"""End to end, real scheduler and CPU worker processes: the host tier
(--kv-offloading-size on both) on a working set that overflows the device pool but
fits device + host.

Four 4-block prefixes, each asked in turn three times, one request at a time, with a
pool of 11 usable blocks (about two requests' worth): without the tier every revisit
recomputes its prefix; with it, every revisit loads the prefix from host memory.
Both store modes (on eviction, write-through). Greedy outputs must be the same tokens (float32) as the run without the tier and as
transformers' reference; the hit rate must be higher; afterwards no device block is
held and no host slot is pinned; the worker's bytes moved match the scheduler's
block counts.
"""

from __future__ import annotations

import random

import pytest
from kvtest.cluster import Cluster, free_port
from kvtest.hf_models import reference_generate
from prometheus_client.parser import text_string_to_metric_families

from bench.kv_block_bytes import kv_bytes_per_block
from protocol.client_messages import Generate

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

BLOCK = 16
NUM_PREFIXES, PREFIX_BLOCKS, ROUNDS = 4, 4, 3
# 12 blocks: 11 usable; a request holds 5 (64 prefix tokens, 3 of tail, 6 out).
DEVICE = ["--num-gpu-blocks-override", "12", "--max-num-seqs", "1"]
# 0.002 GiB of float32 KV blocks of the tiny checkpoint (32 KiB each): 65 host slots.
HOST_GIB = "0.002"


def workload() -> list[Generate]:
    rng = random.Random(11)
    prefixes = [[rng.randrange(2, 512) for _ in range(PREFIX_BLOCKS * BLOCK)] for _ in range(NUM_PREFIXES)]
    return [
        Generate(f"r{r}-p{p}", prefixes[p] + [rng.randrange(2, 512) for _ in range(3)], max_tokens=6, ignore_eos=True)
        for r in range(ROUNDS) for p in range(NUM_PREFIXES)
    ]


def run(tmp_path, name: str, scheduler_args: list[str], worker_args: list[str]):
    """Every request in turn (each sent once the previous finished); outputs, the
    scheduler's metrics, and the worker's /metrics samples."""
    log_dir = tmp_path / name
    log_dir.mkdir()
    worker_http = free_port()
    with Cluster([*DEVICE, *scheduler_args], ["--dtype", "float32", *worker_args, "--http-port", str(worker_http)], log_dir=log_dir) as c:
        outputs = {}
        for g in workload():
            r = c.generate([g], timeout=60)[g.request_id]
            assert r.error is None and r.finish_reason == "length", r
            outputs[g.request_id] = r.token_ids
        m = c.metrics()
        worker = {
            (s.name, s.labels.get("transfer_type")): s.value
            for f in text_string_to_metric_families(c.metrics_text(worker_http)) for s in f.samples
        }
    return outputs, m, worker


@pytest.fixture(scope="module")
def no_tier(tmp_path_factory):
    return run(tmp_path_factory.mktemp("offload"), "no-tier", [], [])


@pytest.fixture(scope="module")
def reference(tiny_reference):
    # The revisits (rounds after the first): the requests whose prefixes the tier serves.
    revisits = workload()[NUM_PREFIXES:]
    return {g.request_id: reference_generate(tiny_reference, g.prompt_token_ids, g.max_tokens, True) for g in revisits}


@pytest.mark.parametrize("store", ["eviction", "full"])
def test_the_host_tier_serves_revisits_with_the_same_outputs(store, no_tier, reference, tmp_path, tiny_checkpoint):
    base_out, base, _ = no_tier
    out, m, worker = run(
        tmp_path, "tier", ["--kv-offloading-size", HOST_GIB, "--kv-offloading-store", store], ["--kv-offloading-size", HOST_GIB]
    )

    # The same greedy tokens, and transformers' (float64 reference) tokens, also for
    # the revisits, whose prefixes came from the host tier.
    assert out == base_out
    for request_id, tokens in reference.items():
        assert out[request_id] == tokens, request_id

    # Without the tier no revisit hits (the pool holds about two requests); with it
    # every revisit finds its whole prefix (4 blocks; the tail is computed).
    queries = base["vllm:prefix_cache_queries_total"]
    assert m["vllm:prefix_cache_queries_total"] == queries == ROUNDS * NUM_PREFIXES * (PREFIX_BLOCKS * BLOCK + 3)
    hits_without = base["vllm:prefix_cache_hits_total"]
    hits_with = m["vllm:prefix_cache_hits_total"] + m["vllm:external_prefix_cache_hits_total"]
    assert hits_without == 0
    assert hits_with == (ROUNDS - 1) * NUM_PREFIXES * PREFIX_BLOCKS * BLOCK
    assert m["vllm:external_prefix_cache_hits_total"] == m["kvpool_kv_offload_loaded_blocks_total"] * BLOCK > 0

    # Idle afterwards: no device block held, no host slot pinned; no block leaked.
    assert m["vllm:kv_cache_usage_perc"] == 0.0 and base["vllm:kv_cache_usage_perc"] == 0.0
    assert m["vllm:kv_offload_cpu_cache_usage_perc"] == 0.0
    assert m["kvpool_free_blocks"] == 11
    assert 0 < m["kvpool_kv_offload_cpu_cached_blocks"] <= m["kvpool_kv_offload_num_cpu_blocks"] == 65

    # The worker moved exactly the blocks the scheduler planned, at the checkpoint's block size.
    per_block = kv_bytes_per_block(tiny_checkpoint, BLOCK, "float32")
    assert worker[("vllm:kv_offload_total_bytes_total", "CPU_to_GPU")] == m["kvpool_kv_offload_loaded_blocks_total"] * per_block
    assert worker[("vllm:kv_offload_total_bytes_total", "GPU_to_CPU")] == m["kvpool_kv_offload_stored_blocks_total"] * per_block
