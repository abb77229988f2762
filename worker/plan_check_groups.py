"""Checking a plan's KV-cache groups beyond the first (hybrid models), before anything
is changed: the part of ``worker.plan_check`` that only a hybrid worker runs.

A hybrid worker keeps one block table per group (protocol.kv_cache_spec). Group 0's
deltas are checked with the plan's own fields; here every group's: the tables of a row
sent whole (``groups.rows``), appends to groups >= 1, and entries nulled in a
sliding-window group (``groups.nulled``, group 0 included), which only grow, stay
within the row, and never reach into the window of the row's next token. Then every
live row's scheduled tokens must fit every group's table.

A sliding group's table may start with null entries (block 0): its blocks wholly
before the window, freed, or never allocated for a prefix-cache hit (vLLM pads a hit
with the null block). A full-attention group's never does.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from protocol.worker_messages import GroupDeltas, StepPlan
from worker.plan_check import Limits, PlanError, RowView, check_block_ids, leading_nulls

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
    group_view: Callable[[int], list[GroupView]],
    group_num_blocks: Callable[[int], list[int]],
    limits: Limits,
    plan: StepPlan,
    live_rows: Collection[int],
    view: Callable[[int], RowView],
    where: str,
) -> None:
    """Raise PlanError if the plan's group deltas cannot be applied (``check_plan``'s
    GroupCheck, with the first three bound). ``group_view(sid)``: a live row's tables
    before the plan, one GroupView per group; ``group_num_blocks(sid)``: only their
    lengths (cheaper); ``live_rows``: the rows live after the plan's rows and appends
    (group 0's already checked); ``view``: their group-0 view."""
    windows = limits.group_windows
    live_rows = set(live_rows)
    if not windows:
        raise PlanError(f"{where}: groups (hybrid KV-cache group deltas) sent to a worker with one full-attention KV-cache group")
    gd = plan.groups or GroupDeltas()
    overlay: dict[int, list[GroupView]] = {}
    for row in (*plan.new_rows, *plan.resumed_rows):
        overlay[row.seq_id] = _row_tables(row.seq_id, row.block_ids, gd, windows, limits, where)
    for sid in gd.rows:
        if sid not in overlay:
            raise PlanError(f"{where}: groups.rows names seq_id {sid}, which is not a row sent whole (new or resumed) in this plan")

    def tables(sid: int) -> list[GroupView]:
        if sid not in overlay:
            overlay[sid] = [list(t) for t in group_view(sid)]
        return overlay[sid]

    for ap in plan.appended:  # group 0's, already checked against its limits
        if ap.seq_id in live_rows:
            tables(ap.seq_id)[0][0] += len(ap.block_ids)
    for ap in gd.appended:
        w = f"{where} groups.appended: seq_id {ap.seq_id} group {ap.group}"
        if not 1 <= ap.group < len(windows):
            raise PlanError(f"{w}: unknown group (this worker's groups 1..{len(windows) - 1} take appends here)")
        if ap.seq_id not in live_rows:
            raise PlanError(f"{where} groups.appended: unknown seq_id {ap.seq_id}")
        check_block_ids(ap.block_ids, limits, w)
        t = tables(ap.seq_id)[ap.group]
        t[0] += len(ap.block_ids)
        if t[0] > limits.max_blocks_per_seq:
            raise PlanError(f"{w}: makes {t[0]} blocks, past max_blocks_per_seq {limits.max_blocks_per_seq}")
    for nb in gd.nulled:
        w = f"{where} groups.nulled: seq_id {nb.seq_id} group {nb.group}"
        if not 0 <= nb.group < len(windows):
            raise PlanError(f"{w}: unknown group (this worker has {len(windows)})")
        if not windows[nb.group]:
            raise PlanError(f"{w}: a full-attention group's entries are never nulled")
        if nb.seq_id not in live_rows:
            raise PlanError(f"{where} groups.nulled: unknown seq_id {nb.seq_id}")
        t = tables(nb.seq_id)[nb.group]
        if nb.num_blocks > t[0]:
            raise PlanError(f"{w}: {nb.num_blocks} null entries, beyond the row's {t[0]} blocks")
        if nb.num_blocks < t[1]:
            raise PlanError(f"{w}: {nb.num_blocks} null entries, fewer than the {t[1]} it has (nulled entries only grow)")
        t[1] = nb.num_blocks
    _check_scheduled(plan, live_rows, view, overlay, group_num_blocks, limits, where)


def _row_tables(sid: int, block_ids: list[int], gd: GroupDeltas, windows: tuple[int, ...], limits: Limits, where: str) -> list[GroupView]:
    """A row sent whole: group 0's table (its block_ids, checked but for leading nulls
    by ``check_row``) and the others' from ``groups.rows``."""
    where = f"{where}: seq_id {sid}"
    others = gd.rows.get(sid)
    if others is None and len(windows) > 1:
        raise PlanError(f"{where} is sent whole without the tables of its groups 1..{len(windows) - 1} (groups.rows)")
    others = others or []
    if len(others) != len(windows) - 1:
        raise PlanError(f"{where} has {len(others)} tables in groups.rows; this worker has {len(windows) - 1} groups beyond group 0")
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
