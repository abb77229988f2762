"""A hybrid model (Gemma 3: sliding and full-attention layers in three KV-cache groups) with
the host tier and with the disk tier, over real scheduler and worker processes.

Four prefixes of 8 blocks, each asked in turn three times with its own tail, one request at a
time, on a device pool that holds about one request: without a tier every revisit computes its
prefix again. With a tier, the device's evictions (every group's blocks under its group-keyed
hash) go to host memory or to disk, and a revisit finds its prefix there: the full-attention
group's every block, each sliding group's window at the prefix's end, loaded into fresh
blocks. The greedy tokens stay transformers' own. The disk tier outlives its processes: a new
scheduler and worker on the same directory find the prefixes on their first requests.
"""

from __future__ import annotations

import json
import random

import pytest
from kvtest import hf_models
from kvtest.cluster import Cluster

from protocol.client_messages import Generate

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

BS = 4
NUM_PREFIXES, PREFIX_BLOCKS, ROUNDS = 4, 8, 3
# Windows [16, 16, 0] x 2: a 35-token prompt and 6 outputs need 11 full-attention blocks and at most
# 6 in each sliding group; 34 blocks hold one request and no other's prefix.
SCHED = ["--block-size", str(BS), "--max-model-len", "128", "--num-gpu-blocks-override", "34", "--max-num-seqs", "1"]
WORKER = ["--block-size", str(BS), "--max-model-len", "128", "--kv-cache-memory", "1MiB", "--dtype", "float32"]
HOST = ["--kv-offloading-size", "0.001"]


def workload(rounds: int = ROUNDS) -> list[Generate]:
    rng = random.Random(5)
    prefixes = [[rng.randrange(3, 200) for _ in range(PREFIX_BLOCKS * BS)] for _ in range(NUM_PREFIXES)]
    return [Generate(f"r{r}-p{p}", prefixes[p] + [rng.randrange(3, 200) for _ in range(3)], max_tokens=6, ignore_eos=True)
            for r in range(rounds) for p in range(NUM_PREFIXES)]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    d = hf_models.make_checkpoint("gemma3", tmp_path_factory.mktemp("gemma3") / "ckpt")
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention"] * 2
    assert cfg["sliding_window"] == 16
    ref = hf_models.load_reference(d)
    return d, {g.request_id: hf_models.reference_generate(ref, g.prompt_token_ids, g.max_tokens) for g in workload()}


def run(log_dir, model, sched_extra=(), worker_extra=(), requests=None):
    """Every request in turn: the results and the scheduler's metrics."""
    log_dir.mkdir()
    with Cluster([*SCHED, *sched_extra], ["--model", str(model), *WORKER, *worker_extra], log_dir=log_dir) as c:
        results = {}
        for g in requests or workload():
            r = c.generate([g], timeout=60)[g.request_id]
            assert r.error is None and r.finish_reason == "length", r
            results[g.request_id] = r
        return results, c.metrics()


def assert_revisits_found_their_prefix(results, m, want):
    assert {rid: r.token_ids for rid, r in results.items()} == want
    # Every revisit finds its 8-block prefix (its tail's block is its own): on the device or in the tier.
    for r in range(1, ROUNDS):
        for p in range(NUM_PREFIXES):
            assert results[f"r{r}-p{p}"].num_cached_tokens == PREFIX_BLOCKS * BS, f"r{r}-p{p}"
    assert m["vllm:external_prefix_cache_hits_total"] > 0


def test_the_host_tier_serves_a_hybrid_models_evicted_prefixes(gemma3, tmp_path):
    d, want = gemma3
    results, m = run(tmp_path / "host", d, HOST, HOST)
    assert_revisits_found_their_prefix(results, m, want)
    assert m["kvpool_kv_offload_loaded_blocks_total"] > 0
    # Loads carry only what the hit reads: the full group's 8 blocks and each sliding group's
    # window at the prefix's end (16 tokens: 4 blocks), per revisit found in host memory.
    revisits = m["vllm:external_prefix_cache_hits_total"] // (PREFIX_BLOCKS * BS)
    assert m["kvpool_kv_offload_loaded_blocks_total"] == revisits * (PREFIX_BLOCKS + 2 * 4)


def test_the_disk_tier_serves_a_hybrid_model_across_a_restart(gemma3, tmp_path):
    d, want = gemma3
    disk = ["--kv-offloading-backend", "disk"]
    worker_disk = [*disk, "--kv-offloading-path", str(tmp_path / "kv"), "--kv-offloading-disk-size", "0.01"]
    results, m = run(tmp_path / "first", d, disk, worker_disk)
    assert_revisits_found_their_prefix(results, m, want)
    # A new scheduler and worker on the same directory: the first round's prompts find their prefixes there.
    first_round = workload(1)
    again = [Generate(f"again-{g.request_id}", g.prompt_token_ids, g.max_tokens, ignore_eos=True) for g in first_round]
    results, m = run(tmp_path / "restart", d, disk, worker_disk, again)
    for g in first_round:
        r = results[f"again-{g.request_id}"]
        assert r.token_ids == want[g.request_id]
        assert r.num_cached_tokens == PREFIX_BLOCKS * BS
    assert m["vllm:external_prefix_cache_hits_total"] == NUM_PREFIXES * PREFIX_BLOCKS * BS
