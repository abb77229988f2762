"""The host tier of a hybrid model: one host tensor per distinct KV tensor (layers of
different KV-cache groups share one), a slot the bytes of one block as the hello counts
them, a store of block b then a load into block c reproducing b in every distinct tensor
(so in both groups' layers), nothing else written; and a prefix loaded back into both
groups' blocks sampling what a recompute samples (either group's left out: other logits).

The tiny checkpoint's 4 layers as Gemma-style windows [8, 0, 8, 0]: group 0 = layers 0
and 2 (window 8), group 1 = layers 1 and 3 (full); 2 KV tensors, tensor 0 holding layers
0 and 1, tensor 1 layers 2 and 3. 2 KV heads of 32 dims in float32, block_size 4: one
tensor's block is 2 * 4 * 2 * 32 * 4 = 2048 bytes, a block 4096.
"""

from __future__ import annotations

import pytest
import torch

from protocol.kv_cache_spec import KVCacheGroupSpec
from protocol.worker_messages import GroupRequestRow, StepPlan, TierCopies
from worker.kv.kv_cache import (
    allocate_host_kv_caches,
    allocate_kv_caches,
    block_bytes,
    layer_kv_caches,
)
from worker.kv.tier_copies import TierCopier
from worker.load.checkpoint import Checkpoint
from worker.models.loader import load_model
from worker.step.runner import ModelRunner

BS, KVH, HD, NUM_BLOCKS, NUM_HOST, MAX_SEQS, MAX_LEN = 4, 2, 32, 16, 6, 2, 32
GROUPS = [KVCacheGroupSpec([0, 2], 8), KVCacheGroupSpec([1, 3], 0)]
BLOCK_BYTES = 2 * 2 * BS * KVH * HD * 4  # 2 tensors of 2048 bytes a block


def hybrid_caches(seed: int | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(the 2 KV tensors, one entry per layer sharing them); random contents with a seed."""
    t = allocate_kv_caches(2, NUM_BLOCKS, BS, KVH, HD, torch.float32, "cpu")
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        for kv in t:
            kv.copy_(torch.randn(kv.shape, generator=g))
    return t, layer_kv_caches(t, GROUPS)


def test_host_memory_is_one_tensor_per_distinct_kv_tensor():
    t, per_layer = hybrid_caches()
    host = allocate_host_kv_caches(per_layer, NUM_HOST)
    assert [tuple(h.shape) for h in host] == [(2, NUM_HOST, BS, KVH, HD)] * 2
    assert block_bytes(per_layer) == BLOCK_BYTES == 4096
    assert sum(h.numel() * h.element_size() for h in host) == NUM_HOST * BLOCK_BYTES
    assert all(int(h.count_nonzero()) == 0 for h in host)


def test_a_stored_block_loads_into_another_block_in_every_distinct_tensor():
    t, per_layer = hybrid_caches(seed=3)
    host = allocate_host_kv_caches(per_layer, NUM_HOST)
    copier = TierCopier(per_layer, host)
    assert len(copier.device_caches) == 2 and copier.device_caches[0] is t[0] and copier.device_caches[1] is t[1]
    before = [kv.clone() for kv in t]
    copier.copy(TierCopies(store_device_ids=[3], store_host_ids=[4]))
    copier.copy(TierCopies(load_host_ids=[4], load_device_ids=[9]))
    copier.finish()
    for kv, old, h in zip(t, before, host, strict=True):
        assert torch.equal(kv[:, 9], old[:, 3]) and torch.equal(h[:, 4], old[:, 3])
        assert torch.equal(kv[:, :9], old[:, :9]) and torch.equal(kv[:, 10:], old[:, 10:])  # only block 9 written
        assert int(h[:, :4].count_nonzero()) == 0 and int(h[:, 5:].count_nonzero()) == 0  # only slot 4 written
    # Every layer of both groups reads block 3's KV at block 9.
    for layer in range(4):
        assert torch.equal(per_layer[layer][:, 9], before[0 if layer in (0, 1) else 1][:, 3])
    assert copier.store_bytes == copier.load_bytes == BLOCK_BYTES


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return load_model(Checkpoint(tiny_checkpoint), torch.float32, "cpu")


def test_the_runner_offloads_both_groups_blocks_of_a_prefill(model):
    t, per_layer = hybrid_caches()
    host = allocate_host_kv_caches(per_layer, NUM_HOST)
    r = ModelRunner(model, per_layer, MAX_SEQS, MAX_LEN, host_caches=host, groups=GROUPS)
    assert len(r.tier.device_caches) == 2 and r.tier.device_caches[0] is t[0] and r.tier.device_caches[1] is t[1]
    assert r.limits.num_host_blocks == NUM_HOST
    # Step 0: 8 tokens; group 0 (layers 0, 2) writes blocks 3 and 4, group 1 (layers 1, 3) blocks 5 and 6.
    r.execute(StepPlan(0, {1: 8}, new_rows=[GroupRequestRow(1, list(range(40, 48)), [3, 4], group_block_ids=[[5, 6]])]))
    for kv in t:
        assert all(int(kv[:, b].count_nonzero()) > 0 for b in (3, 4, 5, 6))
    before = [kv.clone() for kv in t]
    # Step 1: group 0's block 3 and group 1's block 5 into slots 0 and 1, then back into free blocks 10 and 11.
    r.execute(StepPlan(1, {1: 0}, tier_copies=TierCopies([3, 5], [0, 1], [0, 1], [10, 11])))  # seq 1 waits
    for kv, old in zip(t, before, strict=True):
        assert torch.equal(kv[:, 10], old[:, 3]) and torch.equal(kv[:, 11], old[:, 5])
        assert torch.equal(kv[:, :10], old[:, :10]) and torch.equal(kv[:, 12:], old[:, 12:])
    assert r.tier.stored_blocks == r.tier.loaded_blocks == 2 and r.tier.store_bytes == 2 * BLOCK_BYTES


PROMPT = [11, 22, 33, 44, 55, 66, 77, 88, 99, 5]  # 10 tokens: 2 full blocks and 2 more tokens
G0, G1 = [10, 11, 12], [13, 14, 15]  # seq 3's tables: group 0 (layers 0, 2), group 1 (layers 1, 3)


def windowed_runner(model) -> ModelRunner:
    """A hybrid runner with a host tier; layers 0 and 2 attend within 8 tokens."""
    _, per_layer = hybrid_caches()
    return ModelRunner(model, per_layer, MAX_SEQS, MAX_LEN, host_caches=allocate_host_kv_caches(per_layer, NUM_HOST),
                       groups=GROUPS, layer_windows=[8, 0, 8, 0])


def greedy(r: ModelRunner, plan: StepPlan) -> tuple[list[int], torch.Tensor]:
    """The tokens of ``plan`` and the 2 steps after it, and ``plan``'s logits."""
    out = r.execute(plan)
    tokens = list(out.sampled_token_ids)
    for step in range(plan.step_id + 1, plan.step_id + 3):
        tokens += r.execute(StepPlan(step)).sampled_token_ids
    return tokens, out.logits


def loaded_from_the_host_tier(model, load_host_ids: list[int], load_device_ids: list[int]) -> tuple[list[int], torch.Tensor]:
    """Seq 1 prefills PROMPT and its 2 full blocks of each group go to host slots 0..3;
    seq 2 overwrites those device blocks; seq 3 (PROMPT again, 8 tokens computed) loads
    the slots named into its blocks and computes the 2 last tokens."""
    r = windowed_runner(model)
    r.execute(StepPlan(0, {1: len(PROMPT)}, new_rows=[GroupRequestRow(1, PROMPT, [3, 4, 5], group_block_ids=[[6, 7, 8]])]))
    r.execute(StepPlan(1, {}, finished_seq_ids=[1], tier_copies=TierCopies([3, 4, 6, 7], [0, 1, 2, 3])))
    r.execute(StepPlan(2, {2: 8}, new_rows=[GroupRequestRow(2, [3] * 8, [3, 4], group_block_ids=[[6, 7]])]))
    r.execute(StepPlan(3, {}, finished_seq_ids=[2]))
    row = GroupRequestRow(3, PROMPT, G0, num_computed_tokens=8, group_block_ids=[G1])
    return greedy(r, StepPlan(4, {3: 2}, new_rows=[row], tier_copies=TierCopies(load_host_ids=load_host_ids, load_device_ids=load_device_ids)))


def test_a_prefix_loaded_into_both_groups_samples_what_a_recompute_samples(model):
    tokens, logits = loaded_from_the_host_tier(model, [0, 1, 2, 3], [G0[0], G0[1], G1[0], G1[1]])
    recompute = windowed_runner(model)
    ref, ref_logits = greedy(recompute, StepPlan(0, {1: len(PROMPT)}, new_rows=[GroupRequestRow(1, PROMPT, G0, group_block_ids=[G1])]))
    assert tokens == ref
    torch.testing.assert_close(logits, ref_logits[-1:], rtol=1e-5, atol=1e-5)
    # Either group's blocks left out (its layers read zeros), and the step computes other logits.
    _, group0_only = loaded_from_the_host_tier(model, [0, 1], G0[:2])
    _, group1_only = loaded_from_the_host_tier(model, [2, 3], G1[:2])
    assert not torch.allclose(group0_only, logits) and not torch.allclose(group1_only, logits)
