"""Which blocks of a request P/D disaggregation moves, KV-cache group by group (vLLM 0.32's
``remote_block_ids``: one list per group).

A prefill engine lends every group's blocks of the prompt, a sliding-window group's only
its in-window tail (`lent_block_ids`). A decode engine reads them right-aligned on the
prompt's blocks: group g's list holds the prefill's blocks of the *last* ``len`` table
positions (a full-attention group's: every position from 0, whose count gives the
prompt's length; a sliding group's: its tail; with sliding groups only, ``remote_num_tokens``
gives the length), as vLLM's MooncakeConnector aligns them
(``local_group[-n_remote:]``). `remote_span` checks the lists before anything is
allocated; `pull_lists` maps each block to fill to the prefill's block at its position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from scheduler.core.kv_cache_block import KVCacheBlock
from scheduler.core.single_type_kv_cache_manager import cdiv


def lent_block_ids(tables: Sequence[Sequence[int]], group_windows: Sequence[int], block_size: int) -> list[list[int]]:
    """What a prefill engine lends of a finished request's ``tables`` (one per group, 0 for a
    null entry): each group's blocks without the nulls, a sliding group (window W) only its
    last ``cdiv(W, block_size) + 1`` (vLLM 0.32's ``get_exchange_clipped_blocks``: the
    window of the prompt's last token, one more for a window not aligned to blocks)."""
    lent = []
    for table, window in zip(tables, group_windows, strict=True):
        kept = [b for b in table if b]
        lent.append(kept[-(cdiv(window, block_size) + 1):] if window else kept)
    return lent


@dataclass(frozen=True, slots=True)
class RemoteSpan:
    """What a decode engine may read: the prefill's table length in blocks (``num_positions``;
    group g's list is right-aligned on it) and the prompt tokens its blocks hold."""

    num_positions: int
    num_tokens: int


def remote_span(remote: Sequence[Sequence[int]], group_windows: Sequence[int], block_size: int, remote_num_tokens: int | None,
                num_prompt_tokens: int) -> RemoteSpan | str:
    """The span of ``remote`` (``kv_transfer_params.remote_block_ids``) for a prompt of
    ``num_prompt_tokens`` on an engine of ``group_windows``, or why it cannot be read (a
    group count not this engine's, full-attention lists of different lengths, a
    sliding group's tail short of the window of the prompt's last token, sliding groups only
    without ``remote_num_tokens``)."""
    key = "kv_transfer_params.remote_block_ids"
    if len(remote) != len(group_windows):
        return f"{key} names {len(remote)} KV-cache groups, this engine has {len(group_windows)}"
    full = {len(r) for r, w in zip(remote, group_windows, strict=True) if not w}
    if len(full) > 1:
        return f"{key}: the full-attention groups' lists differ in length"
    if full:
        (num_positions,) = full
    elif remote_num_tokens is None:
        return f"{key}: sliding-window groups only, and no kv_transfer_params.remote_num_tokens to give the prompt's length"
    else:
        # NOTE: sliding groups only: the prefill's table ends at the block of its last computed token.
        num_positions = cdiv(remote_num_tokens, block_size)
    num_tokens = min(num_positions * block_size, num_prompt_tokens)
    if remote_num_tokens is not None:
        num_tokens = min(num_tokens, remote_num_tokens)
    for g, (r, w) in enumerate(zip(remote, group_windows, strict=True)):
        # NOTE: the prompt's last token is computed again here: it attends to the W tokens ending with it.
        if w and num_positions - len(r) > max(0, num_tokens - w) // block_size:
            return f"{key}[{g}]: {len(r)} blocks do not cover the window of {w} tokens at the prompt's end ({num_tokens} tokens)"
    return RemoteSpan(num_positions, num_tokens)


def pull_lists(remote: Sequence[Sequence[int]], span: RemoteSpan, targets: Sequence[tuple[int, int, KVCacheBlock]]) -> tuple[list[list[int]], list[int]]:
    """The remote blocks to read, one list per group in table order, and the local blocks
    they go to, in the same order flattened (group by group), for ``targets`` ((group,
    position, block), `KVCacheManager.load_targets`). ValueError naming a target whose block
    the prefill engine did not lend."""
    per_group: list[list[int]] = [[] for _ in remote]
    local: list[list[int]] = [[] for _ in remote]
    for g, i, block in sorted(targets, key=lambda t: (t[0], t[1])):
        r = remote[g]
        first = span.num_positions - len(r)
        if not first <= i < span.num_positions:
            raise ValueError(f"the block of group {g} at position {i} is not lent: the prefill engine lent positions {first}..{span.num_positions - 1}")
        per_group[g].append(r[i - first])
        local[g].append(block.block_id)
    return per_group, [b for blocks in local for b in blocks]
