"""What a plan is checked against (DESIGN.md, the contract): the worker's limits, the
error a refused plan raises, and the checks of a block id list shared by the group-0
check (``plan_check``) and the other groups' (``plan_check_groups``)."""

from __future__ import annotations

from dataclasses import dataclass


class PlanError(ValueError):
    """A plan the worker refuses; the message names what broke the contract."""


@dataclass(frozen=True, slots=True)
class Limits:
    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_blocks_per_seq: int
    max_model_len: int
    vocab_size: int
    # Host slots of the offload tier (WorkerReady.num_host_blocks); 0: no tier.
    num_host_blocks: int = 0
    # The KV-cache groups' windows (WorkerHello.group_windows); (): one full-attention group.
    group_windows: tuple[int, ...] = ()


# (num_tokens, num_computed_tokens, num_blocks) of one row.
RowView = tuple[int, int, int]


def leading_nulls(block_ids: list[int]) -> int:
    """How many of ``block_ids``' first entries are the null block 0."""
    n = 0
    for b in block_ids:
        if b != 0:
            break
        n += 1
    return n


def check_block_ids(block_ids: list[int], limits: Limits, where: str) -> None:
    # NOTE: block 0 is the null block (rule 1): never handed out, so never in a row.
    if block_ids and (min(block_ids) < 1 or max(block_ids) >= limits.num_blocks):
        bad = next(b for b in block_ids if not 1 <= b < limits.num_blocks)
        raise PlanError(f"{where}: block id {bad} is outside the cache (valid ids 1..{limits.num_blocks - 1})")
