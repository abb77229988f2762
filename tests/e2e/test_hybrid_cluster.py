"""A Gemma 3 checkpoint (sliding and full layers) served by a real scheduler and worker
over ZeroMQ: the worker's hello asks for the hybrid manager, the plans carry the groups'
deltas, and greedy tokens equal transformers' for prompts past the window of 16, sharing
a prefix (a second round hits the cache). --disable-hybrid-kv-cache-manager in one
process: tests/worker/step/test_hybrid_with_scheduler.py."""

from __future__ import annotations

import json

import pytest
from kvtest import hf_models
from kvtest.cluster import Cluster

from protocol.client_messages import Generate

PREFIX = [(13 * i + 5) % 200 + 3 for i in range(32)]
PROMPTS = [PREFIX + [(7 * i + j) % 200 + 3 for i in range(8 + 4 * j)] for j in range(3)]


@pytest.fixture
def gemma3(tmp_path):
    d = hf_models.make_checkpoint("gemma3", tmp_path / "gemma3")
    ref = hf_models.load_reference(d)
    return d, [hf_models.reference_generate(ref, p, 6) for p in PROMPTS]


def test_gemma3_served_over_the_wire_equals_transformers(gemma3, tmp_path):
    d, want = gemma3
    sched = ["--block-size", "4", "--max-model-len", "128", "--max-num-batched-tokens", "24"]
    worker = ["--model", str(d), "--block-size", "4", "--max-model-len", "128", "--kv-cache-memory", "1MiB"]
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention"] * 2
    # Windows [16, 16, 0] x 2: groups {0, 3}, {1, 4} sliding and {2, 5} full, so 2 KV tensors:
    # a block of 4 tokens costs 2 (K, V) x 2 tensors x 4 x kv heads x head dim x 4 bytes.
    per_block = 2 * 2 * 4 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    with Cluster(sched, worker, log_dir=tmp_path) as c:
        assert c.metrics()["kvpool_num_gpu_blocks"] == 1024 * 1024 // per_block
        # NOTE: a pool that evicts nothing: under vLLM's retention 0 a sliding group keeps only
        # the tails at each prompt's end, and which survive a smaller pool depends on timing.
        for round_ in range(2):  # the second round hits the blocks the first one cached
            got = c.generate([Generate(f"r{round_}-{j}", p, 6, ignore_eos=True) for j, p in enumerate(PROMPTS)])
            assert [got[f"r{round_}-{j}"].token_ids for j in range(len(PROMPTS))] == want
            assert all(got[f"r{round_}-{j}"].error is None for j in range(len(PROMPTS)))
        # Each prompt again: its whole blocks up to its last token (40, 44, 48 tokens, bs 4).
        assert [got[f"r1-{j}"].num_cached_tokens for j in range(3)] == [36, 40, 44]
