"""A hybrid worker's KV-cache groups in the runner: per-group block tables built from
hand-written plans (rows sent whole, appends, nulled entries), refused plans leaving
every table as it was, and each layer attending through its group's table and window.

The tiny checkpoint has 4 layers; as Gemma-style windows [8, 0, 8, 0] they make two
groups (protocol.kv_cache_spec): group 0 = layers 0 and 2, sliding (window 8 = 2 blocks
of 4 tokens); group 1 = layers 1 and 3, full attention; 2 KV tensors.
"""

from __future__ import annotations

import copy

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
from worker.step.plan_check import PlanError
from worker.step.runner import ModelRunner

BS, NUM_BLOCKS, MAX_SEQS, MAX_LEN = 4, 32, 3, 32  # max_blocks_per_seq = 8
GROUPS = [KVCacheGroupSpec([0, 2], 8), KVCacheGroupSpec([1, 3], 0)]
WINDOWS = [8, 0, 8, 0]
TOKENS_24 = list(range(100, 124))
TOKENS_6 = [11, 22, 33, 44, 55, 66]


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return load_model(Checkpoint(tiny_checkpoint), torch.float32, "cpu")


def new_runner(model, groups=GROUPS, layer_windows=None) -> ModelRunner:
    c = model.config
    n = max(len(g.layer_ids) for g in groups)
    tensors = allocate_kv_caches(n, NUM_BLOCKS, BS, c.num_kv_heads, c.head_dim, torch.float32, "cpu")
    return ModelRunner(model, layer_kv_caches(tensors, groups), MAX_SEQS, MAX_LEN, groups=groups, layer_windows=layer_windows)


def started(model) -> ModelRunner:
    """Step 0 applied, no token computed: seq 1 (24 tokens, a 20-token prefix hit whose
    first 2 sliding blocks are null) and seq 2 (6 tokens)."""
    r = new_runner(model)
    r.execute(StepPlan(0, {1: 0, 2: 0}, new_rows=[GroupRequestRow(1, TOKENS_24, [0, 0, 3, 4, 5, 25], 20, group_block_ids=[[6, 7, 8, 9, 10, 26]]),
                                                 GroupRequestRow(2, TOKENS_6, [11, 12], group_block_ids=[[13, 14]])]))
    return r


def tables(r: ModelRunner) -> list[list[list[int]]]:
    """Per group, the host table's rows as lists (all MAX_SEQS rows, zeros included)."""
    return [t.block_table_cpu.tolist() for t in r.groups.tables]


def snapshot(r: ModelRunner):
    ts = r.groups.tables
    return (r.next_step_id, [t.block_table_cpu.clone() for t in ts], [t.block_table.clone() for t in ts],
            [list(t.num_blocks_per_row) for t in ts], [dict(t.row_of) for t in ts], [list(t._free_rows) for t in ts],
            copy.deepcopy(r.rows))


def assert_same(a, b):
    assert a[0] == b[0] and a[3:] == b[3:]
    assert all(torch.equal(x, y) for x, y in zip(a[1] + a[2], b[1] + b[2], strict=True))


def test_rows_appends_and_nulled_entries_per_group(model):
    r = started(model)
    t0, t1 = r.groups.tables
    assert t0 is r.block_table and r.limits.group_windows == (8, 0)
    assert tables(r) == [
        [[0, 0, 3, 4, 5, 25, 0, 0], [11, 12, 0, 0, 0, 0, 0, 0], [0] * 8],
        [[6, 7, 8, 9, 10, 26, 0, 0], [13, 14, 0, 0, 0, 0, 0, 0], [0] * 8],
    ]
    assert r.groups.view(1) == [[6, 2], [6, 0]] and r.groups.view(2) == [[2, 0], [2, 0]]
    # Step 1: seq 2 grows in both groups; seq 1's third sliding block leaves the window
    # (20 computed, window 8: tokens 0..12 are outside it, so 3 blocks may be null).
    r.execute(StepPlan(1, {1: 0, 2: 0}, appended=[AppendedBlocks(2, [15]), GroupAppendedBlocks(2, 1, [16]), NulledBlocks(1, 0, 3)]))
    assert tables(r) == [
        [[0, 0, 0, 4, 5, 25, 0, 0], [11, 12, 15, 0, 0, 0, 0, 0], [0] * 8],
        [[6, 7, 8, 9, 10, 26, 0, 0], [13, 14, 16, 0, 0, 0, 0, 0], [0] * 8],
    ]
    assert all(torch.equal(t.block_table, t.block_table_cpu) for t in (t0, t1))  # committed to the device copy
    # Step 2: seq 1 finishes, seq 3 arrives, seq 2 is sent whole again (resumed): each
    # table drops and adds rows in the same order, so a request has one row everywhere.
    r.execute(StepPlan(2, {2: 0, 3: 0}, finished_seq_ids=[1], new_rows=[GroupRequestRow(3, [5, 6, 7], [23], group_block_ids=[[24]])],
                       resumed_rows=[GroupRequestRow(2, TOKENS_6, [17, 18], group_block_ids=[[20, 21]])]))
    assert t0.row_of == t1.row_of == {3: 0, 2: 1}
    assert tables(r) == [
        [[23, 0, 0, 0, 0, 0, 0, 0], [17, 18, 0, 0, 0, 0, 0, 0], [0] * 8],
        [[24, 0, 0, 0, 0, 0, 0, 0], [20, 21, 0, 0, 0, 0, 0, 0], [0] * 8],
    ]


def _refused_plans() -> list[tuple[StepPlan, str]]:
    row3 = RequestRow(3, TOKENS_6, [27, 28])

    def grow3(tables: list[list[int]]) -> GroupRequestRow:
        return GroupRequestRow(3, TOKENS_6, [27, 28], group_block_ids=tables)

    return [
        (StepPlan(1, appended=[GroupAppendedBlocks(2, 0, [15])]), "seq_id 2 group 0: unknown group"),
        (StepPlan(1, appended=[GroupAppendedBlocks(2, 2, [15])]), "seq_id 2 group 2: unknown group"),
        (StepPlan(1, appended=[GroupAppendedBlocks(9, 1, [15])]), "appended: unknown seq_id 9"),
        (StepPlan(1, appended=[NulledBlocks(1, 2, 3)]), "seq_id 1 group 2: unknown group"),
        (StepPlan(1, appended=[NulledBlocks(1, 1, 1)]), "a full-attention group's entries are never nulled"),
        (StepPlan(1, appended=[NulledBlocks(1, 0, 7)]), "7 null entries, beyond the row's 6 blocks"),
        (StepPlan(1, appended=[NulledBlocks(1, 0, 1)]), "1 null entries, fewer than the 2 it has"),
        (StepPlan(1, appended=[NulledBlocks(1, 0, 4)]), "seq_id 1 group 0 has 4 null entries, reaching into the window"),
        (StepPlan(1, new_rows=[row3]), "seq_id 3 is sent whole without the tables of its groups 1..1 (a RequestRow, not a GroupRequestRow)"),
        (StepPlan(1, new_rows=[grow3([[29], [30]])]), "has 2 tables in group_block_ids; this worker has 1"),
        (StepPlan(1, new_rows=[grow3([])]), "has 0 tables in group_block_ids; this worker has 1"),
        (StepPlan(1, new_rows=[grow3([[0, 29]])]), "seq_id 3 group 1: block id 0 is outside the cache"),
        (StepPlan(1, new_rows=[GroupRequestRow(3, TOKENS_6, [27, 0], group_block_ids=[[29, 30]])]), "block id 0 is outside the cache"),
        (StepPlan(1, new_rows=[grow3([[29, 99]])]), "block id 99 is outside the cache"),
        (StepPlan(1, appended=[GroupAppendedBlocks(2, 1, list(range(15, 22)))]), "makes 9 blocks, past max_blocks_per_seq 8"),
        (StepPlan(1, {1: 0, 2: 0, 3: 6}, new_rows=[grow3([[29]])]), "seq_id 3 is scheduled up to position 5 but its group 1 table holds 4 tokens"),
    ]


@pytest.mark.parametrize(("plan", "words"), _refused_plans())
def test_a_refused_plan_changes_no_group_table(model, plan, words):
    r = started(model)
    before = snapshot(r)
    with pytest.raises(PlanError, match="step 1") as e:
        r.execute(plan)
    assert words in str(e.value)
    assert_same(snapshot(r), before)


def test_groups_sent_to_a_one_group_worker_are_refused(model):
    r = new_runner(model, [KVCacheGroupSpec([0, 1, 2, 3])])
    assert len(r.groups.tables) == 1 and r.limits.group_windows == ()  # one table: the runner's own
    group_row = GroupRequestRow(1, TOKENS_6, [11, 12], group_block_ids=[[13, 14]])
    for plan in (StepPlan(0, new_rows=[group_row]), StepPlan(0, new_rows=[RequestRow(1, TOKENS_6, [11, 12])], appended=[NulledBlocks(1, 0, 1)])):
        with pytest.raises(PlanError, match="hybrid KV-cache group deltas sent to a worker with one full-attention KV-cache group"):
            r.execute(plan)
    assert r.next_step_id == 0


class RecordingAttention:
    """The runner's PagedAttention, recording the metadata it is asked for; it attends
    with the first one (the window itself is helper code of the attention, not tested here)."""

    def __init__(self, real):
        self.real, self.built, self.steps = real, [], []

    def build_metadata(self, table, slots, decode_rows, decode_context_lens, prefills, **kw):
        self.built.append((table, slots.tolist(), kw))
        return self.real.build_metadata(table, slots, decode_rows, decode_context_lens, prefills)

    def for_step(self, metadata):
        self.steps.append(metadata)
        return self.real.for_step(metadata[0] if isinstance(metadata, list) else metadata)


def _prefill_seq_5(r: ModelRunner, group_block_ids: list[list[int]] | None) -> RecordingAttention:
    rec = r.attention = RecordingAttention(r.attention)
    row = RequestRow(5, TOKENS_6, [11, 12]) if group_block_ids is None else GroupRequestRow(5, TOKENS_6, [11, 12], group_block_ids=group_block_ids)
    out = r.execute(StepPlan(0, {5: 6}, new_rows=[row]))
    assert out.seq_ids == [5]
    return rec


def test_each_layer_writes_and_attends_through_its_groups_table_and_window(model):
    r = new_runner(model)
    rec = _prefill_seq_5(r, [[13, 14]])
    t0, t1 = r.groups.tables
    # Positions 0..5: blocks (11, 11, 11, 11, 12, 12) in group 0, (13, ..., 14, 14) in group 1; slot = block * 4 + position % 4.
    assert [(table, slots, kw) for table, slots, kw in rec.built] == [
        (t0.block_table, [44, 45, 46, 47, 48, 49], {"sliding_window": 8}),
        (t1.block_table, [52, 53, 54, 55, 56, 57], {}),
    ]
    (per_layer,) = rec.steps
    assert len(per_layer) == 4 and per_layer[0] is per_layer[2] and per_layer[1] is per_layer[3] and per_layer[0] is not per_layer[1]


def test_disable_hybrid_one_full_group_still_attends_within_each_layers_window(model):
    r = new_runner(model, [KVCacheGroupSpec([0, 1, 2, 3])], layer_windows=WINDOWS)
    assert r.limits.group_windows == ()  # the hello says one full group: no group deltas
    rec = _prefill_seq_5(r, None)
    slots = [44, 45, 46, 47, 48, 49]
    assert [(table is r.block_table.block_table, s, kw) for table, s, kw in rec.built] == [(True, slots, {"sliding_window": 8}), (True, slots, {})]
    (per_layer,) = rec.steps
    assert per_layer[0] is per_layer[2] and per_layer[1] is per_layer[3] and per_layer[0] is not per_layer[1]


def test_one_full_group_builds_one_metadata_as_today(model):
    r = new_runner(model, [KVCacheGroupSpec([0, 1, 2, 3])])
    rec = _prefill_seq_5(r, None)
    assert [(s, kw) for _, s, kw in rec.built] == [([44, 45, 46, 47, 48, 49], {})]
    assert not isinstance(rec.steps[0], list)


def test_one_sliding_group_takes_null_entries_without_group_rows(model):
    # Mistral with a window: every layer in one sliding group; the hello says [8].
    r = new_runner(model, [KVCacheGroupSpec([0, 1, 2, 3], 8)])
    assert r.limits.group_windows == (8,)
    r.execute(StepPlan(0, {1: 0}, new_rows=[RequestRow(1, TOKENS_24, [0, 3, 4, 5, 6, 7], 20)]))
    r.execute(StepPlan(1, {1: 0}, appended=[NulledBlocks(1, 0, 3)]))
    assert r.block_table.block_ids(1) == [0, 0, 0, 5, 6, 7]
    with pytest.raises(PlanError, match="nulled: seq_id 1 group 1: unknown group"):
        r.execute(StepPlan(2, appended=[NulledBlocks(1, 1, 3)]))


def test_layer_windows_must_match_a_sliding_groups_window(model):
    with pytest.raises(ValueError, match="layer 2 has window 4 but its KV-cache group 0 has window 8"):
        new_runner(model, layer_windows=[8, 0, 4, 0])
