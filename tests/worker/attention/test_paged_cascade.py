"""Shared-prefix (cascade) decode attention: rows that start with the same physical
blocks attend to them together and merge with their own blocks by log-sum-exp.

Checked against attention computed densely in float64 from each row's own block list
(no paging code involved), and against transformers through the runner with every
shareable prefix taken (``cascade_min_tokens = 1``).
"""

from __future__ import annotations

import random

import pytest
import torch
from kvtest.hf_models import load_reference, make_checkpoint, reference_generate, reference_logits
from kvtest.mini_scheduler import MiniScheduler

from worker.attention.paged_attention import PagedAttention
from worker.kv.kv_cache import allocate_kv_caches
from worker.load.checkpoint import Checkpoint
from worker.models.loader import load_model
from worker.step.block_table import BlockTable
from worker.step.runner import ModelRunner

BS, KVH, NH, HD, NUM_BLOCKS = 4, 2, 8, 16, 64

# (blocks, context length) per decode row, in decode order. Group A shares 3 blocks
# (rows 0, 2, 5); group B's rows share blocks 7, 11 and 3, but row 4's context (8 tokens)
# ends in block 11, so the group's prefix is block 7 alone; rows 3 and 6 share nothing;
# group C (rows 8, 9) shares blocks 12-14, consecutive ids, read in place.
ROWS = [
    ([5, 9, 2, 20, 21], 18),
    ([7, 11, 3, 30], 15),
    ([5, 9, 2, 22], 13),
    ([40, 41], 6),
    ([7, 11], 8),
    ([5, 9, 2, 23, 24, 25], 21),
    ([50, 51, 52], 12),
    ([7, 11, 3, 31, 32], 17),
    ([12, 13, 14, 60], 15),
    ([12, 13, 14, 61, 62], 18),
]
EXPECTED_GROUPS = {(0, 2, 5): 3, (1, 4, 7): 1, (8, 9): 3}  # decode indices -> shared blocks


def dense_attention(cache: torch.Tensor, q: torch.Tensor, blocks: list[int], ctx: int, scale: float = HD**-0.5) -> torch.Tensor:
    """q (nh, hd) over the first ctx tokens of ``blocks``, float64 -> (nh, hd)."""
    k = cache[0, blocks].reshape(-1, KVH, HD)[:ctx].double()  # (ctx, kvh, hd)
    v = cache[1, blocks].reshape(-1, KVH, HD)[:ctx].double()
    out = torch.empty(NH, HD, dtype=torch.float64)
    for h in range(NH):
        kv = h // (NH // KVH)
        p = torch.softmax(k[:, kv] @ q[h].double() * scale, dim=0)  # (ctx,)
        out[h] = p @ v[:, kv]
    return out


def run_decode(dtype: torch.dtype, cascade_min_tokens: int | None, scale: float | None = None):
    gen = torch.Generator().manual_seed(0)
    cache = allocate_kv_caches(1, NUM_BLOCKS, BS, KVH, HD, dtype, "cpu")[0]
    cache.copy_(torch.randn(cache.shape, generator=gen, dtype=torch.float64))
    table = BlockTable(len(ROWS), 8, BS, "cpu")
    for i, (blocks, _) in enumerate(ROWS):
        table.add_row(i, blocks)
    table.commit()
    n = len(ROWS)
    q = torch.randn(n, NH, HD, generator=gen, dtype=torch.float64).to(dtype)
    k = torch.randn(n, KVH, HD, generator=gen, dtype=torch.float64).to(dtype)
    v = torch.randn(n, KVH, HD, generator=gen, dtype=torch.float64).to(dtype)
    rows = torch.arange(n)
    positions = torch.tensor([ctx - 1 for _, ctx in ROWS])
    slots = table.compute_slot_mapping(rows, positions)
    attention = PagedAttention([cache], NH, 8, cascade_min_tokens=cascade_min_tokens, scale=scale)
    md = attention.build_metadata(table.block_table, slots, list(range(n)), [ctx for _, ctx in ROWS], [])
    with torch.inference_mode():
        out = attention.forward(0, q, k, v, md)
    return cache, q, out, md


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_cascade_equals_dense_attention(dtype):
    cache, q, out, md = run_decode(dtype, cascade_min_tokens=1)
    groups = {tuple(s.token_idx.tolist()): s.num_blocks for s in md.shared_prefixes}
    assert groups == EXPECTED_GROUPS
    # Block 7 alone is a run of one; 5, 9, 2 is no run.
    assert {tuple(s.token_idx.tolist()): s.first_block for s in md.shared_prefixes} == {(0, 2, 5): None, (1, 4, 7): 7, (8, 9): 12}
    # The current token's K/V were written before attention, so the cache holds them.
    # NOTE: bfloat16 merges in float32 (its own outputs rounded to 3 digits first).
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    for i, (blocks, ctx) in enumerate(ROWS):
        ref = dense_attention(cache, q[i], blocks, ctx)
        torch.testing.assert_close(out[i].double(), ref, rtol=tol, atol=tol, msg=f"row {i}")


def test_cascade_with_an_attention_scale_equals_dense_attention():
    # Gemma 3's scale (query_pre_attn_scalar ** -0.5) reaches the shared prefix and the own blocks alike.
    cache, q, out, md = run_decode(torch.float64, cascade_min_tokens=1, scale=0.3)
    assert len(md.shared_prefixes) == 3
    for i, (blocks, ctx) in enumerate(ROWS):
        torch.testing.assert_close(out[i], dense_attention(cache, q[i], blocks, ctx, 0.3), rtol=1e-12, atol=1e-12, msg=f"row {i}")


def test_cascade_off_and_threshold():
    _, _, plain, md_off = run_decode(torch.float64, cascade_min_tokens=None)
    assert md_off.shared_prefixes == []
    # Group A saves (3 - 1) x 3 blocks x 4 tokens = 24 gathered tokens, group B 8, group C 12.
    _, _, _, md = run_decode(torch.float64, cascade_min_tokens=24)
    assert [tuple(s.token_idx.tolist()) for s in md.shared_prefixes] == [(0, 2, 5)]
    _, _, merged, _ = run_decode(torch.float64, cascade_min_tokens=1)
    torch.testing.assert_close(merged, plain, rtol=1e-12, atol=1e-12)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def checkpoint(request, tmp_path_factory):
    path = make_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    return path, load_reference(path)


def cascade_runner(path, block_size=4):
    model = load_model(Checkpoint(path), torch.float32, "cpu")
    c = model.config
    caches = allocate_kv_caches(c.num_layers, 256, block_size, c.num_kv_heads, c.head_dim, torch.float32, "cpu")
    runner = ModelRunner(model, caches, 16, 128)
    runner.attention.cascade_min_tokens = 1  # every shareable prefix takes the shared path
    seen = []
    build = runner.attention.build_metadata

    def counting(*args):
        md = build(*args)
        seen.append(len(md.shared_prefixes))
        return md

    runner.attention.build_metadata = counting
    return runner, seen


def test_shared_prefix_decodes_match_transformers(checkpoint):
    path, hf = checkpoint
    runner, seen = cascade_runner(path)
    rng = random.Random(3)
    sched = MiniScheduler(runner, rng, 256, 4)
    sched.add(0, [rng.randrange(2, 100) for _ in range(30)], 24)
    while sched.live[0].computed < 16:  # NOTE: no preemption yet: it samples nothing before 30
        sched.step()
    for sid in range(1, 5):  # each reads the donor's full blocks, then its own tokens
        sched.add(sid, [rng.randrange(2, 100) for _ in range(rng.randint(24, 34))], 12, share_from=0)
    sched.run()
    assert sum(seen) > 0, "no step took the shared-prefix path"
    for sid, req in sched.done.items():
        ref = reference_logits(hf, req.prompt + req.out)  # (T, V) float64
        for pos, logits in req.logits:
            scale = float(ref[pos].abs().max())
            torch.testing.assert_close(logits.double(), ref[pos], rtol=1e-4, atol=1e-4 * scale, msg=f"seq {sid} pos {pos}")
        assert req.out == reference_generate(hf, req.prompt, req.max_tokens), f"seq {sid}"
