"""The offload tier's copies in the runner: stores into host slots and loads back into
other device blocks reproduce the KV bytes exactly; a block stored and reused in one
step keeps its old content in the host slot; a request whose prefix was loaded from
the host tier samples what a recompute samples; bad ids are refused whole."""

from __future__ import annotations

import copy

import pytest
import torch
from kvtest.hf_models import reference_generate

from protocol.worker_messages import RequestRow, StepPlan, TierCopies
from worker.kv.kv_cache import allocate_host_kv_caches, allocate_kv_caches
from worker.kv.tier_copies import TierCopier, runs
from worker.load.checkpoint import Checkpoint
from worker.models.loader import load_model
from worker.step.plan_check import PlanError
from worker.step.runner import ModelRunner

BS, NUM_BLOCKS, NUM_HOST, MAX_SEQS, MAX_LEN = 4, 32, 8, 3, 32
PROMPT = [11, 22, 33, 44, 55, 66, 77, 88, 99, 5]  # 10 tokens: 2 full blocks and 2 more tokens


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return load_model(Checkpoint(tiny_checkpoint), torch.float64, "cpu")


def new_runner(model, host: bool = True) -> ModelRunner:
    c = model.config
    caches = allocate_kv_caches(c.num_layers, NUM_BLOCKS, BS, c.num_kv_heads, c.head_dim, torch.float64, "cpu")
    hosts = allocate_host_kv_caches(caches, NUM_HOST) if host else None
    return ModelRunner(model, caches, MAX_SEQS, MAX_LEN, host_caches=hosts)


def device_block(r: ModelRunner, b: int) -> list[torch.Tensor]:
    return [kv[:, b].clone() for kv in r.attention.kv_caches]


def host_slot(r: ModelRunner, h: int) -> list[torch.Tensor]:
    return [kv[:, h].clone() for kv in r.tier.host_caches]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def prefilled(model) -> ModelRunner:
    """Step 0: seq 1 prefills PROMPT into blocks [5, 9, 12] and samples."""
    r = new_runner(model)
    out = r.execute(StepPlan(0, {1: len(PROMPT)}, new_rows=[RequestRow(1, PROMPT, [5, 9, 12])]))
    assert out.seq_ids == [1]
    return r


def test_runs_merge_consecutive_pairs_only():
    assert runs([4, 5, 6, 9, 2], [0, 1, 2, 3, 7]) == [(4, 0, 3), (9, 3, 1), (2, 7, 1)]
    assert runs([3, 4], [5, 4]) == [(3, 5, 1), (4, 4, 1)]
    assert runs([], []) == []


def test_store_then_load_into_other_blocks_reproduces_the_bytes(model):
    r = prefilled(model)
    full = [device_block(r, 5), device_block(r, 9)]
    assert not same(full[0], full[1]) and full[0][0].abs().sum() > 0
    # Step 1: seq 1 finishes; its two full blocks are stored into host slots 6 and 2.
    r.execute(StepPlan(1, {}, finished_seq_ids=[1], tier_copies=TierCopies([5, 9], [6, 2])))
    assert same(host_slot(r, 6), full[0]) and same(host_slot(r, 2), full[1])
    # Step 2: the device blocks are rewritten by another request (as a reused block would be).
    r.execute(StepPlan(2, {2: 8}, new_rows=[RequestRow(2, [7] * 8, [5, 9])]))
    assert not same(device_block(r, 5), full[0])
    # Step 3: the slots are loaded into other device blocks: the same bytes, exactly.
    r.execute(StepPlan(3, {2: 0}, tier_copies=TierCopies(load_host_ids=[2, 6], load_device_ids=[21, 20])))
    assert same(device_block(r, 20), full[0]) and same(device_block(r, 21), full[1])
    assert (r.tier.stored_blocks, r.tier.loaded_blocks, r.tier.store_steps, r.tier.load_steps) == (2, 2, 1, 1)
    assert r.tier.store_bytes == r.tier.load_bytes == 2 * r.tier.block_bytes > 0


def test_a_block_stored_and_reused_in_one_step_keeps_its_old_content_in_the_slot(model):
    r = prefilled(model)
    old5, old9 = device_block(r, 5), device_block(r, 9)
    r.execute(StepPlan(1, {1: 0}, tier_copies=TierCopies([9], [3])))  # slot 3 holds block 9's K/V
    # One step: block 5 is stored into slot 1 and loaded into from slot 3; block 9 is
    # stored into slot 4, and slot 4 is loaded into block 30 (it reads the new content).
    r.execute(StepPlan(2, {1: 0}, tier_copies=TierCopies([5, 9], [1, 4], [3, 4], [5, 30])))
    assert same(host_slot(r, 1), old5)
    assert same(device_block(r, 5), old9)
    assert same(device_block(r, 30), old9) and same(host_slot(r, 4), old9)


def test_prefix_loaded_from_the_host_tier_samples_what_a_recompute_samples(model, tiny_reference):
    expected = reference_generate(tiny_reference, PROMPT, 3)
    r = prefilled(model)
    r.execute(StepPlan(1, {}, finished_seq_ids=[1], tier_copies=TierCopies([5, 9], [0, 7])))
    # Blocks 5 and 9 are reused (overwritten) by another request, then it finishes.
    r.execute(StepPlan(2, {2: 8}, new_rows=[RequestRow(2, [3] * 8, [5, 9])]))
    r.execute(StepPlan(3, {}, finished_seq_ids=[2]))
    # Seq 3: the same prompt; its first 8 tokens' K/V come from the host tier, loaded
    # in the step that prefills the 2 remaining tokens.
    tc = TierCopies(load_host_ids=[0, 7], load_device_ids=[14, 3])
    out = r.execute(StepPlan(4, {3: 2}, new_rows=[RequestRow(3, PROMPT, [14, 3, 25], num_computed_tokens=8)], tier_copies=tc))
    tokens = list(out.sampled_token_ids)
    for step in range(5, 7):
        tokens += r.execute(StepPlan(step)).sampled_token_ids
    recompute = new_runner(model, host=False)
    ref = [recompute.execute(StepPlan(0, {1: len(PROMPT)}, new_rows=[RequestRow(1, PROMPT, [5, 9, 12])])).sampled_token_ids[0]]
    for step in range(1, 3):
        ref += recompute.execute(StepPlan(step)).sampled_token_ids
    assert tokens == ref == expected
    # Without the load, the same plan reads the blocks' stale K/V and samples otherwise.
    r2 = prefilled(model)
    r2.execute(StepPlan(1, {}, finished_seq_ids=[1]))
    r2.execute(StepPlan(2, {2: 8}, new_rows=[RequestRow(2, [3] * 8, [14, 3])]))
    r2.execute(StepPlan(3, {}, finished_seq_ids=[2]))
    stale = r2.execute(StepPlan(4, {3: 2}, new_rows=[RequestRow(3, PROMPT, [14, 3, 25], num_computed_tokens=8)]))
    assert not torch.equal(stale.logits, out.logits)


def snapshot(r: ModelRunner):
    return (
        r.next_step_id, r.num_steps, copy.deepcopy(r.rows), dict(r.block_table.row_of),
        [kv.clone() for kv in r.attention.kv_caches], [kv.clone() for kv in r.tier.host_caches],
        (r.tier.stored_blocks, r.tier.loaded_blocks, r.tier.store_bytes, r.tier.load_bytes),
    )


def assert_unchanged(a, b):
    assert a[:4] == b[:4] and a[6] == b[6]
    assert all(torch.equal(x, y) for x, y in zip(a[4] + a[5], b[4] + b[5], strict=True))


@pytest.mark.parametrize(("tc", "words"), [
    (TierCopies([0], [1]), "block id 0 is outside the cache"),
    (TierCopies([NUM_BLOCKS], [1]), f"block id {NUM_BLOCKS} is outside the cache"),
    (TierCopies([5], [NUM_HOST]), f"host slot {NUM_HOST} is outside the tier (valid slots 0..{NUM_HOST - 1})"),
    (TierCopies(load_host_ids=[-1], load_device_ids=[5]), "host slot -1 is outside the tier"),
    (TierCopies([5, 9], [1]), "2 store_device_ids but 1 store_host_ids"),
    (TierCopies(load_host_ids=[1], load_device_ids=[5, 6]), "2 load_device_ids but 1 load_host_ids"),
    (TierCopies([5, 9], [2, 2]), "store_host_ids names 2 twice"),
    (TierCopies(load_host_ids=[1, 2], load_device_ids=[7, 7]), "load_device_ids names 7 twice"),
])
def test_bad_ids_are_refused_with_the_state_unchanged(model, tc, words):
    r = prefilled(model)
    before = snapshot(r)
    # The bad copies ride on an otherwise valid plan (a new row): nothing of it applies.
    plan = StepPlan(1, {2: 3}, new_rows=[RequestRow(2, [1, 2, 3], [20])], tier_copies=tc)
    with pytest.raises(PlanError, match="tier_copies") as e:
        r.execute(plan)
    assert words in str(e.value)
    assert_unchanged(before, snapshot(r))
    r.execute(StepPlan(1, {1: 1}))  # and the next valid plan runs


def test_copies_without_a_host_tier_are_refused(model):
    r = new_runner(model, host=False)
    with pytest.raises(PlanError, match="no host tier"):
        r.execute(StepPlan(0, tier_copies=TierCopies([5], [0])))
    assert r.next_step_id == 0


def test_a_host_tier_that_does_not_match_the_device_cache_is_refused():
    dev = allocate_kv_caches(2, 8, 4, 2, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="does not match the device cache"):
        TierCopier(dev, allocate_host_kv_caches(allocate_kv_caches(2, 8, 4, 2, 16, torch.float32, "cpu"), 4))
    with pytest.raises(ValueError, match="2 device caches but 1 host caches"):
        TierCopier(dev, allocate_host_kv_caches(dev, 4)[:1])
    host = allocate_host_kv_caches(dev, 4)
    assert [tuple(h.shape) for h in host] == [(2, 4, 4, 2, 8)] * 2 and not host[0].is_pinned()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_copies_run_on_a_side_stream_and_reproduce_the_bytes():
    dev = allocate_kv_caches(3, 16, 4, 2, 8, torch.bfloat16, "cuda")
    for kv in dev:
        kv.normal_()
    host = allocate_host_kv_caches(dev, 8)
    assert host[0].is_pinned()
    tier = TierCopier(dev, host)
    old = [kv[:, [3, 5]].cpu() for kv in dev]
    # Block 5 is stored and loaded into in one step; slot 2 is stored and loaded too.
    tier.copy(TierCopies([3, 5], [2, 7], [2, 7], [5, 9]))
    tier.finish()
    for kv, h, o in zip(dev, host, old, strict=True):
        assert torch.equal(h[:, [2, 7]], o)
        assert torch.equal(kv[:, 5].cpu(), o[:, 0]) and torch.equal(kv[:, 9].cpu(), o[:, 1])
    assert tier.store_seconds > 0 and tier.load_seconds > 0
