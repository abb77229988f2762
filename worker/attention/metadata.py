"""What attention needs for one step (``AttentionMetadata``), built once per step by
``PagedAttention.build_metadata`` and shared by every layer (of one KV-cache group and
window, when the model has several)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class DecodeGroup:
    start: int  # token range [start, end) among the step's decode tokens
    end: int
    block_ids: torch.Tensor  # (n * num_ctx_blocks,) int64: each row's blocks after its shared prefix
    num_ctx_blocks: int
    bias: torch.Tensor | None  # (n, 1, 1, num_ctx_blocks * block_size), 0 or -inf; None: no padding


@dataclass(slots=True)
class DecodeRows:
    """The decode rows as the in-place kernel (``worker.attention.paged_decode``) reads
    them, in the decode order: row i attends to keys [lead[i], num_keys[i]) counted from
    column first_col[i] of block table row table_row[i]."""

    table: torch.Tensor  # (max_num_seqs, max_blocks_per_seq) int32, the step's block table
    table_row: np.ndarray  # (B,) int64
    first_col: np.ndarray  # (B,) int64: after the row's shared prefix, or its window's first column
    num_keys: np.ndarray  # (B,) int64, >= 1
    lead: np.ndarray  # (B,) int64: keys of the first column before the window (0 without one)


@dataclass(slots=True)
class PrefillRows:
    """The prefill chunks as the in-place kernel (``worker.attention.paged_prefill``) reads
    them: chunk c is the step's tokens [offset[c], offset[c] + num_queries[c]), at positions
    from first[c] of block table row table_row[c], attending causally (within the window)."""

    table: torch.Tensor  # (max_num_seqs, max_blocks_per_seq) int32, the step's block table
    table_row: np.ndarray  # (C,) int64
    first: np.ndarray  # (C,) int64: the chunk's first position (its request's computed tokens)
    num_queries: np.ndarray  # (C,) int64, >= 1
    offset: np.ndarray  # (C,) int64


@dataclass(slots=True)
class SharedPrefix:
    token_idx: torch.Tensor  # (m,) int64: the group's rows among the decode tokens
    start: int  # the same rows as the range [start, end) of the decode order attention uses
    end: int
    block_ids: torch.Tensor  # (num_blocks,) int64: the prefix every row of the group starts with
    num_blocks: int
    first_block: int | None  # the id of its first block when the ids run consecutively


@dataclass(slots=True)
class PrefillChunk:
    start: int  # token range [start, end) in the step batch
    end: int
    block_ids: torch.Tensor  # (num_ctx_blocks,) int64
    num_ctx_blocks: int
    mask: torch.Tensor  # (n, num_ctx_blocks * block_size) bool, causal from num_computed (and within the window)
    first_block: int | None  # the id of its first block when the ids run consecutively


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs for one step; built once, shared by every layer."""

    slot_mapping: torch.Tensor  # (T,) int64
    num_decode_tokens: int
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillChunk]
    shared_prefixes: list[SharedPrefix]
    # With shared prefixes, decode attention runs in an order where each group's rows are
    # adjacent, groups first (the last group ends where the ungrouped rows start):
    # decode_order[j] is the step's decode token at place j.
    decode_order: torch.Tensor | None = None
    sliding_window: int = 0  # the window it attends within, 0: full attention
    # The decode rows for the in-place kernel, which then replaces decode_groups (empty).
    decode_rows: DecodeRows | None = None
    # The prefill chunks for the in-place kernel, which then replaces prefills (empty).
    prefill_rows: PrefillRows | None = None


def first_if_consecutive(ids: np.ndarray) -> int | None:
    """ids[0] when the block ids run ids[0], ids[0] + 1, ...; else None."""
    if len(ids) == 0 or (len(ids) > 1 and not (np.diff(ids) == 1).all()):
        return None
    return int(ids[0])
