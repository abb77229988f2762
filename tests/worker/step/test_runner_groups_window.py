"""Hybrid groups end to end in the runner: a prompt longer than the window, prefilled in
chunks and decoded while the sliding group's blocks behind the window are nulled (and
then overwritten with NaN, as if reused), gives the same tokens and logits as the same
layers with --disable-hybrid-kv-cache-manager (one full group, nothing freed, each layer
still attending within its window)."""

from __future__ import annotations

import pytest
import torch

from protocol.kv_cache_spec import KVCacheGroupSpec
from protocol.worker_messages import (
    AppendedBlocks,
    GroupAppendedBlocks,
    GroupRequestRow,
    NulledBlocks,
    RequestRow,
    StepPlan,
)
from worker.kv.kv_cache import allocate_kv_caches, layer_kv_caches
from worker.load.checkpoint import Checkpoint
from worker.models.loader import load_model
from worker.step.runner import ModelRunner

BS, W = 4, 8
HYBRID = [KVCacheGroupSpec([0, 2], W), KVCacheGroupSpec([1, 3], 0)]
ONE_FULL = [KVCacheGroupSpec([0, 1, 2, 3], 0)]
PROMPT = [(7 * i + 3) % 500 + 2 for i in range(20)]
GROUP1 = 20  # group 1's block ids are group 0's plus this (ids are unique across groups)


def runner(model, groups) -> ModelRunner:
    c = model.config
    tensors = allocate_kv_caches(max(len(g.layer_ids) for g in groups), 48, BS, c.num_kv_heads, c.head_dim, torch.float32, "cpu")
    return ModelRunner(model, layer_kv_caches(tensors, groups), 2, 64, groups=groups, layer_windows=[W, 0, W, 0])


def plans(hybrid: bool):
    """Step 0 and 1: the prompt in chunks of 12 and 8; then 8 decodes. Before each step
    the sliding group nulls what vLLM frees: (computed - W + 1) // BS blocks."""
    if hybrid:
        row = GroupRequestRow(1, PROMPT, [1, 2, 3, 4, 5], group_block_ids=[[21, 22, 23, 24, 25]])
    else:
        row = RequestRow(1, PROMPT, [1, 2, 3, 4, 5])
    yield StepPlan(0, {1: 12}, new_rows=[row])
    blocks, computed, step = 5, 12, 1
    for n in (8, *[1] * 8):
        nulls = max(0, computed - W + 1) // BS
        appended = []
        if computed + n > blocks * BS:
            blocks += 1
            appended.append(AppendedBlocks(1, [blocks]))
            if hybrid:
                appended.append(GroupAppendedBlocks(1, 1, [blocks + GROUP1]))
        if hybrid:
            appended.append(NulledBlocks(1, 0, nulls))
        yield StepPlan(step, {1: n} if n > 1 else {}, appended=appended)
        computed, step = computed + n, step + 1


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return load_model(Checkpoint(tiny_checkpoint), torch.float32, "cpu")


def test_hybrid_groups_equal_one_full_group_with_windows(model):
    hybrid, full = runner(model, HYBRID), runner(model, ONE_FULL)
    assert hybrid.limits.group_windows == (W, 0) and full.limits.group_windows == ()
    tokens = []
    for hp, fp in zip(plans(True), plans(False), strict=True):
        a, b = hybrid.execute(hp), full.execute(fp)
        assert a.sampled_token_ids == b.sampled_token_ids
        if a.logits is not None:
            torch.testing.assert_close(a.logits, b.logits, rtol=1e-5, atol=1e-5)
            tokens += a.sampled_token_ids
        # The blocks the sliding group nulled (ids 1..k, its first k) were freed and may
        # be reused by another request at once: poison them in every tensor.
        freed = list(range(1, hybrid.groups.tables[0].num_null_leading(1) + 1))
        for kv in hybrid.attention.kv_caches:
            kv[:, freed] = float("nan")
    # The last step's token is at position 27 and attends to 20..27: blocks 0..4 are null.
    assert len(tokens) == 9 and hybrid.groups.tables[0].num_null_leading(1) == 5
