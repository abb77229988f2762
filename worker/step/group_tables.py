"""A worker's KV-cache groups in the step (vLLM's per-group block tables and attention
metadata; protocol.kv_cache_spec): one ``BlockTable`` per group, each layer writing and
attending through its group's table, with its own window. One group (most models) is
the case of one table and one attention metadata.

The runner keeps group 0's table (``ModelRunner.block_table``) and its rows' state, and
adds and drops group 0's rows itself; ``GroupTables`` holds every group's table (group
0's is the same object) and applies the rest of a plan: rows dropped and added in the
same order in every other table, so a request has the same row in every group; then the
plan's table deltas in order (appends to any group, nulled entries).

Attention metadata is built once per distinct (group, layer window) pair: normally one
per group; with --disable-hybrid-kv-cache-manager the one full group has a window-0
metadata and one per window of its sliding layers (they still attend within it).

"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from protocol.kv_cache_spec import KVCacheGroupSpec
from protocol.worker_messages import NulledBlocks, StepPlan
from worker.attention.metadata import AttentionMetadata
from worker.attention.paged_attention import PagedAttention
from worker.step.block_table import BlockTable
from worker.step.step_inputs import StepInputs


def hello_group_windows(groups: Sequence[KVCacheGroupSpec]) -> list[int]:
    """WorkerHello.group_windows: each group's window; [] for one full-attention group."""
    if len(groups) == 1 and not groups[0].sliding_window:
        return []
    return [g.sliding_window for g in groups]


def layer_pairs(groups: Sequence[KVCacheGroupSpec], layer_windows: Sequence[int]) -> tuple[list[tuple[int, int]], list[int]]:
    """The distinct (group, window) pairs in order of first layer, and each layer's index
    into them. A layer of a sliding group attends with that group's window; a layer of a
    full group with its own (--disable-hybrid-kv-cache-manager keeps every layer's KV)."""
    group_of = {layer: g for g, spec in enumerate(groups) for layer in spec.layer_ids}
    if sorted(group_of) != list(range(len(layer_windows))):
        raise ValueError(f"the KV-cache groups cover layers {sorted(group_of)}, the model has {len(layer_windows)}")
    pairs: list[tuple[int, int]] = []
    index: list[int] = []
    for layer, window in enumerate(layer_windows):
        g = group_of[layer]
        group_window = groups[g].sliding_window
        if group_window and window != group_window:
            raise ValueError(f"layer {layer} has window {window} but its KV-cache group {g} has window {group_window}")
        if (g, window) not in pairs:
            pairs.append((g, window))
        index.append(pairs.index((g, window)))
    return pairs, index


class GroupTables:
    def __init__(self, groups: Sequence[KVCacheGroupSpec], layer_windows: Sequence[int], table0: BlockTable):
        """``groups``: the KV-cache groups (one: every layer in one full-attention group);
        ``layer_windows``: each layer's window; ``table0``: the runner's table, group 0's."""
        self.windows = tuple(g.sliding_window for g in groups)
        self.pairs, self.layer_pair = layer_pairs(groups, layer_windows)
        t = table0
        device = t.block_table.device
        self.tables = [table0] + [BlockTable(t.max_num_seqs, t.max_blocks_per_seq, t.block_size, device) for _ in groups[1:]]

    def view(self, seq_id: int) -> list[list[int]]:
        """[num_blocks, num_null_leading] of each group's table of a live row."""
        return [[t.num_blocks(seq_id), t.num_null_leading(seq_id)] for t in self.tables]

    def num_blocks(self, seq_id: int) -> list[int]:
        """Each group's table length of a live row."""
        return [t.num_blocks(seq_id) for t in self.tables]

    def apply(self, plan: StepPlan) -> None:
        """The plan's deltas but group 0's rows (added and dropped by the runner first):
        rows in groups >= 1, then the table deltas of every group in order. Only after
        the plan passed ``check_plan``."""
        tables = self.tables
        for g in range(1, len(tables)):
            t = tables[g]
            for sid in plan.finished_seq_ids:
                t.remove_row(sid)
            for sid in plan.preempted_seq_ids:
                t.remove_row(sid)
            for row in plan.new_rows:
                t.add_row(row.seq_id, row.group_block_ids[g - 1])
            for row in plan.resumed_rows:
                if row.seq_id in t.row_of:
                    t.remove_row(row.seq_id)
                t.add_row(row.seq_id, row.group_block_ids[g - 1])
        for d in plan.appended:
            if type(d) is NulledBlocks:
                tables[d.group].null_leading(d.seq_id, d.num_blocks)
            else:
                tables[d.group].append(d.seq_id, d.block_ids)
        for t in tables:
            t.commit()

    def step_metadata(
        self, attention: PagedAttention, rows: torch.Tensor, positions: torch.Tensor, inputs: StepInputs
    ) -> AttentionMetadata | list[AttentionMetadata]:
        """Each group's slot mapping from its table and one metadata per (group, window)
        pair: the one, or each layer's pair's. Call after commit."""
        slots = [t.compute_slot_mapping(rows, positions) for t in self.tables]  # per group, (T,)
        metadata = []
        for g, window in self.pairs:
            args = (self.tables[g].block_table, slots[g], inputs.decode_rows, inputs.decode_context_lens, inputs.prefills)
            # NOTE: the window only when there is one, so window-0 calls keep build_metadata's signature.
            metadata.append(attention.build_metadata(*args, sliding_window=window) if window else attention.build_metadata(*args))
        if len(metadata) == 1:
            return metadata[0]
        return [metadata[i] for i in self.layer_pair]
