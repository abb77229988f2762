"""One step's inputs as the model runner lays them out (``ModelRunner._prepare_inputs``),
read by the runner and by the hybrid groups' attention (worker/step/group_tables.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class StepInputs:
    """One step's scheduled tokens, decodes first (see ``ModelRunner._prepare_inputs``)."""

    decode_seq_ids: list[int]
    prefill_seq_ids: list[int]
    decode_rows: list[int]  # per decode token, its block-table row
    decode_context_lens: list[int]  # per decode token, its position + 1
    prefills: list[tuple[int, int, int]]  # per prefill chunk, (row, num_computed, n)
    token_ids: list[int]  # (T,) the step's tokens
    positions: list[int]  # (T,)
    rows: list[int]  # (T,) each token's block-table row
    # seq_id -> the drafts scheduled after its last token (the plan's spec_token_ids).
    drafts: dict[int, list[int]]
