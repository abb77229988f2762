"""Checking a plan's KV-cache groups beyond the first (hybrid models), before anything
is changed: the part of ``worker.step.plan_check`` that runs when the worker has several
groups (or one sliding-window group).

A worker keeps one block table per group (protocol.kv_cache_spec). Group 0's deltas are
checked by ``plan_check``; here every group's: the tables of a row sent whole
(``GroupRequestRow.group_block_ids``), appends to groups >= 1 (``GroupAppendedBlocks``),
and entries nulled in a sliding-window group (``NulledBlocks``, group 0 included), which
only grow, stay within the row, and never reach into the window of the row's next token,
all in the plan's order. Then every live row's scheduled tokens must fit every group's table.

A sliding group's table may start with null entries (block 0): its blocks wholly
before the window, freed, or never allocated for a prefix-cache hit (vLLM pads a hit
with the null block). A full-attention group's never does.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from protocol.worker_messages import (
    AppendedBlocks,
    GroupAppendedBlocks,
    GroupRequestRow,
    NulledBlocks,
    RequestRow,
    StepPlan,
)
from worker.step.group_tables import GroupTables
from worker.step.plan_limits import Limits, PlanError, RowView, check_block_ids, leading_nulls

# One group's table of one row: [num_blocks, num_null_leading].
GroupView = list[int]


def check_table(block_ids: list[int], window: int, limits: Limits, where: str) -> GroupView:
    """A group's whole table: in the cache, within max_blocks_per_seq, and null (0) only
    in a leading run of a sliding group's."""
    if len(block_ids) > limits.max_blocks_per_seq:
        raise PlanError(f"{where}: {len(block_ids)} blocks, past max_blocks_per_seq {limits.max_blocks_per_seq}")
    nulls = leading_nulls(block_ids) if window else 0
    check_block_ids(block_ids[nulls:], limits, where)
    return [len(block_ids), nulls]


def check_groups(
    tables: GroupTables,
    limits: Limits,
    plan: StepPlan,
    live_rows: Collection[int],
    view: Callable[[int], RowView],
    where: str,
) -> None:
    """Raise PlanError if the plan's group deltas cannot be applied. ``tables``: the live
    rows' tables before the plan; ``live_rows``: the rows live after the plan's rows and
    appends (group 0's already checked); ``view``: their group-0 view."""
    windows = limits.group_windows
    live_rows = set(live_rows)
    overlay: dict[int, list[GroupView]] = {}
    for row in (*plan.new_rows, *plan.resumed_rows):
        overlay[row.seq_id] = _row_tables(row, windows, limits, where)

    def tables_of(sid: int) -> list[GroupView]:
        if sid not in overlay:
            overlay[sid] = [list(t) for t in tables.view(sid)]
        return overlay[sid]

    for d in plan.appended:
        if type(d) is AppendedBlocks:  # group 0's, already checked against its limits
            if d.seq_id in live_rows:
                tables_of(d.seq_id)[0][0] += len(d.block_ids)
        elif type(d) is GroupAppendedBlocks:
            _appended(d, live_rows, tables_of, windows, limits, where)
        else:
            _nulled(d, live_rows, tables_of, windows, where)
    _check_scheduled(plan, live_rows, view, overlay, tables.num_blocks, limits, where)


def _appended(ap: GroupAppendedBlocks, live_rows: set[int], tables_of: Callable[[int], list[GroupView]], windows: tuple[int, ...],
              limits: Limits, where: str) -> None:
    w = f"{where} appended: seq_id {ap.seq_id} group {ap.group}"
    if not 1 <= ap.group < len(windows):
        raise PlanError(f"{w}: unknown group (this worker's groups 1..{len(windows) - 1} take GroupAppendedBlocks)")
    if ap.seq_id not in live_rows:
        raise PlanError(f"{where} appended: unknown seq_id {ap.seq_id}")
    check_block_ids(ap.block_ids, limits, w)
    t = tables_of(ap.seq_id)[ap.group]
    t[0] += len(ap.block_ids)
    if t[0] > limits.max_blocks_per_seq:
        raise PlanError(f"{w}: makes {t[0]} blocks, past max_blocks_per_seq {limits.max_blocks_per_seq}")


def _nulled(nb: NulledBlocks, live_rows: set[int], tables_of: Callable[[int], list[GroupView]], windows: tuple[int, ...],
            where: str) -> None:
    w = f"{where} nulled: seq_id {nb.seq_id} group {nb.group}"
    if not 0 <= nb.group < len(windows):
        raise PlanError(f"{w}: unknown group (this worker has {len(windows)})")
    if not windows[nb.group]:
        raise PlanError(f"{w}: a full-attention group's entries are never nulled")
    if nb.seq_id not in live_rows:
        raise PlanError(f"{where} nulled: unknown seq_id {nb.seq_id}")
    t = tables_of(nb.seq_id)[nb.group]
    if nb.num_blocks > t[0]:
        raise PlanError(f"{w}: {nb.num_blocks} null entries, beyond the row's {t[0]} blocks")
    if nb.num_blocks < t[1]:
        raise PlanError(f"{w}: {nb.num_blocks} null entries, fewer than the {t[1]} it has (nulled entries only grow)")
    t[1] = nb.num_blocks


def _row_tables(row: RequestRow, windows: tuple[int, ...], limits: Limits, where: str) -> list[GroupView]:
    """A row sent whole: group 0's table (its block_ids, checked but for leading nulls
    by ``check_row``) and the others' (a GroupRequestRow's group_block_ids)."""
    where = f"{where}: seq_id {row.seq_id}"
    block_ids, others = row.block_ids, row.group_block_ids
    if type(row) is not GroupRequestRow and len(windows) > 1:
        raise PlanError(f"{where} is sent whole without the tables of its groups 1..{len(windows) - 1} (a RequestRow, not a GroupRequestRow)")
    if len(others) != len(windows) - 1:
        raise PlanError(f"{where} has {len(others)} tables in group_block_ids; this worker has {len(windows) - 1} groups beyond group 0")
    if not windows[0] and 0 in block_ids:
        raise PlanError(f"{where} group 0: block id 0 is the null block, never in a full-attention group's table")
    first = [len(block_ids), leading_nulls(block_ids) if windows[0] else 0]
    return [first] + [check_table(t, windows[g], limits, f"{where} group {g}") for g, t in enumerate(others, 1)]


def _check_scheduled(
    plan: StepPlan,
    live_rows: Collection[int],
    view: Callable[[int], RowView],
    overlay: dict[int, list[GroupView]],
    group_num_blocks: Callable[[int], list[int]],
    limits: Limits,
    where: str,
) -> None:
    """Every live row's scheduled tokens fit every group's table, and no group's null
    entries reach the window of the row's next token (position ``computed`` attends to
    (computed - W, computed]: vLLM frees at most computed - W + 1 tokens). A row this
    plan leaves alone kept its null entries while its computed tokens grew: only its
    tables' lengths are read."""
    scheduled, bs, windows = plan.num_scheduled_tokens, limits.block_size, limits.group_windows
    for sid in live_rows:
        n = scheduled.get(sid, 1)
        computed = view(sid)[1]
        tables = overlay.get(sid)
        for g, num_blocks in enumerate(group_num_blocks(sid) if tables is None else [t[0] for t in tables]):
            if computed + n > num_blocks * bs:
                raise PlanError(f"{where}: seq_id {sid} is scheduled up to position {computed + n - 1} but its group {g} table holds "
                                f"{num_blocks * bs} tokens")
        for g, (_, nulls) in enumerate(tables or ()):
            if nulls * bs > max(0, computed - windows[g] + 1):
                raise PlanError(f"{where}: seq_id {sid} group {g} has {nulls} null entries, reaching into the window of "
                                f"{windows[g]} tokens of position {computed}")
