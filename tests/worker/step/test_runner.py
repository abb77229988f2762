"""Applying plans: rows added, grown, finished, preempted, resumed; and plans that
break the contract, refused whole with the worker's state exactly as it was."""

from __future__ import annotations

import copy

import pytest
import torch
from kvtest.hf_models import reference_generate

from protocol.worker_messages import AppendedBlocks, RequestRow, StepPlan
from worker.cpu.threads import StepThreads
from worker.kv.kv_cache import allocate_kv_caches
from worker.load.checkpoint import Checkpoint
from worker.models.loader import load_model
from worker.step.plan_check import PlanError
from worker.step.runner import ModelRunner

VOCAB_SIZE = 512  # the tiny default checkpoint's
BS, NUM_BLOCKS, MAX_SEQS, MAX_LEN = 4, 32, 3, 32  # max_blocks_per_seq = 8
PROMPT_A = [11, 22, 33, 44, 55, 66]
PROMPT_B = [7, 8, 9]


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return load_model(Checkpoint(tiny_checkpoint), torch.float64, "cpu")


def new_runner(model) -> ModelRunner:
    c = model.config
    caches = allocate_kv_caches(c.num_layers, NUM_BLOCKS, BS, c.num_kv_heads, c.head_dim, torch.float64, "cpu")
    return ModelRunner(model, caches, MAX_SEQS, MAX_LEN)


def started(model) -> ModelRunner:
    """Step 0 done: seq 1 (A) prefilled whole and sampled; seq 2 (B) 2 of 3 tokens."""
    r = new_runner(model)
    out = r.execute(StepPlan(0, {1: 6, 2: 2}, new_rows=[RequestRow(1, PROMPT_A, [5, 9]), RequestRow(2, PROMPT_B, [12])]))
    assert out.seq_ids == [1]
    return r


def snapshot(r: ModelRunner):
    bt = r.block_table
    return (
        r.next_step_id,
        bt.block_table_cpu.clone(),
        bt.block_table.clone(),
        list(bt.num_blocks_per_row),
        dict(bt.row_of),
        list(bt._free_rows),
        copy.deepcopy(r.rows),
        [kv.clone() for kv in r.attention.kv_caches],
        (r.num_steps, r.num_tokens_computed, r.kv_bytes_written),
    )


def assert_same(a, b):
    assert a[0] == b[0]
    assert torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])
    assert a[3:7] == b[3:7]
    assert all(torch.equal(x, y) for x, y in zip(a[7], b[7], strict=True))
    assert a[8] == b[8]


def test_rows_new_append_finish_preempt_resume(model, tiny_reference):
    r = started(model)
    bt = r.block_table
    assert bt.row_of == {1: 0, 2: 1}
    assert bt.block_ids(1) == [5, 9] and bt.block_ids(2) == [12]
    assert r.rows[1].num_computed_tokens == 6 and len(r.rows[1].token_ids) == 7
    assert r.rows[2].num_computed_tokens == 2 and r.rows[2].token_ids == PROMPT_B
    # Step 1: B finishes its prefill (1 token, samples); A decodes; C arrives.
    out = r.execute(StepPlan(1, {3: 5}, new_rows=[RequestRow(3, [1, 2, 3, 4, 5], [20, 21])], appended=[AppendedBlocks(2, [13])]))
    assert sorted(out.seq_ids) == [1, 2, 3]
    assert bt.block_ids(2) == [12, 13]
    # Step 2: A finishes, B is preempted, C decodes.
    r.execute(StepPlan(2, finished_seq_ids=[1], preempted_seq_ids=[2]))
    assert set(r.rows) == {3} and bt.row_of == {3: 2}
    assert bt.block_table_cpu[:2].sum() == 0  # cleared rows point at the null block
    # Step 3: B resumes whole on new blocks, recomputed from 0.
    out = r.execute(StepPlan(3, {2: 3}, resumed_rows=[RequestRow(2, PROMPT_B, [30])]))
    assert bt.block_ids(2) == [30] and r.rows[2].num_computed_tokens == 3
    assert out.sampled_token_ids[out.seq_ids.index(2)] == reference_generate(tiny_reference, PROMPT_B, 1)[0]
    # A resumed row replaces a live one whole.
    r.execute(StepPlan(4, {2: 0, 3: 0}, resumed_rows=[RequestRow(3, [1, 2, 3], [25], 0)]))
    assert bt.block_ids(3) == [25] and r.rows[3].token_ids == [1, 2, 3]


def test_unscheduled_row_keeps_its_state(model):
    r = started(model)
    before = copy.deepcopy(r.rows[2])
    out = r.execute(StepPlan(1, {2: 0}))
    assert out.seq_ids == [1] and r.rows[2] == before


BAD_PLANS = [
    (StepPlan(2), "step_id 2 is a gap"),
    (StepPlan(0), "step_id 0 is a repeat"),
    (StepPlan(1, finished_seq_ids=[99]), "unknown seq_id 99 in finished_seq_ids"),
    (StepPlan(1, preempted_seq_ids=[99]), "unknown seq_id 99 in preempted_seq_ids"),
    (StepPlan(1, finished_seq_ids=[1], preempted_seq_ids=[1]), "seq_id 1 is removed twice"),
    (StepPlan(1, appended=[AppendedBlocks(99, [3])]), "unknown seq_id 99 in appended"),
    (StepPlan(1, {99: 1}), "unknown seq_id 99 in num_scheduled_tokens"),
    (StepPlan(1, {2: 0}, new_rows=[RequestRow(1, [1], [3])]), "new row seq_id 1 is already live"),
    (StepPlan(1, {3: 1}, new_rows=[RequestRow(3, [1], [0])]), "block id 0 is outside the cache"),
    (StepPlan(1, {3: 1}, new_rows=[RequestRow(3, [1], [NUM_BLOCKS])]), f"block id {NUM_BLOCKS} is outside the cache"),
    (StepPlan(1, appended=[AppendedBlocks(2, [-1])]), "block id -1 is outside the cache"),
    (StepPlan(1, {3: 1}, new_rows=[RequestRow(3, [1], list(range(1, 10)))]), "9 blocks, past max_blocks_per_seq 8"),
    (StepPlan(1, appended=[AppendedBlocks(1, [1, 2, 3, 4, 6, 7, 8])]), "makes 9 blocks, past max_blocks_per_seq 8"),
    (StepPlan(1, {3: 1, 4: 1}, new_rows=[RequestRow(3, [1], [3]), RequestRow(4, [1], [4])]), "4 live rows, more than max_num_seqs 3"),
    (StepPlan(1, {2: 5}), "seq_id 2 is scheduled 5 tokens but has only 1 not yet computed"),
    (StepPlan(1, {3: 5}, new_rows=[RequestRow(3, list(range(10)), [3])]), "its 1 blocks hold 4 tokens"),
    (StepPlan(1, {2: -1}), "negative number of scheduled tokens"),
    (StepPlan(1, {3: 1}, new_rows=[RequestRow(3, [1, VOCAB_SIZE], [3])]), f"token id {VOCAB_SIZE} outside the vocabulary"),
    (StepPlan(1, {3: 0}, new_rows=[RequestRow(3, [1, 2], [3], 4)]), "num_computed_tokens 4 outside 0..2"),
    (StepPlan(1, {3: 0}, new_rows=[RequestRow(3, [], [3])]), "seq_id 3 has no tokens"),
    (StepPlan(1, {3: 1}, new_rows=[RequestRow(3, [1] * (MAX_LEN + 1), [3])]), "past max_model_len"),
    (StepPlan(1, resumed_rows=[RequestRow(2, [1], [3]), RequestRow(2, [1], [4])]), "sent twice"),
]


@pytest.mark.parametrize(("plan", "message"), BAD_PLANS, ids=[m for _, m in BAD_PLANS])
def test_bad_plan_is_refused_and_state_is_unchanged(model, tiny_reference, plan, message):
    r = started(model)
    before = snapshot(r)
    with pytest.raises(PlanError, match=message.replace("(", r"\(").replace(")", r"\)")):
        r.execute(plan)
    assert_same(before, snapshot(r))
    # The next valid plan works, and decodes as if nothing had happened.
    out = r.execute(StepPlan(1, {2: 1}))
    sampled = dict(zip(out.seq_ids, out.sampled_token_ids, strict=True))
    assert sampled == {1: reference_generate(tiny_reference, PROMPT_A, 2)[1], 2: reference_generate(tiny_reference, PROMPT_B, 1)[0]}




def test_a_big_step_runs_its_forward_on_the_wide_thread_count(model, monkeypatch):
    c = model.config
    caches = allocate_kv_caches(c.num_layers, NUM_BLOCKS, BS, c.num_kv_heads, c.head_dim, torch.float64, "cpu")
    runner = ModelRunner(model, caches, MAX_SEQS, MAX_LEN, step_threads=StepThreads(wide=3, min_tokens=5))
    seen, forward = [], model.forward
    monkeypatch.setattr(model, "forward", lambda *a: seen.append(torch.get_num_threads()) or forward(*a))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runner.execute(StepPlan(0, {1: 6, 2: 2}, new_rows=[RequestRow(1, PROMPT_A, [5, 9]), RequestRow(2, PROMPT_B, [12])]))
        runner.execute(StepPlan(1))  # two decode tokens: below 5
        assert seen == [3, 1] and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
