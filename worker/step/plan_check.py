"""Checking a StepPlan against the worker's state before anything is changed.

A plan that breaks the contract is refused whole (a ``PlanError`` naming the problem)
and the worker's state stays exactly as it was, so the scheduler can answer it and
send the next valid plan. Checking first and then applying (which cannot fail) is what
makes that true: there is nothing to roll back.

The check simulates the plan's order (DESIGN.md rule 3) on an overlay of the rows it
touches: drop finished and preempted rows, add new rows, replace resumed rows, append
block ids, then every live row's scheduled tokens must exist and fit its blocks. With
several KV-cache groups every group's tables are checked too (``worker.step.plan_check_groups``);
a one-group worker refuses group data.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from protocol.worker_messages import (
    AppendedBlocks,
    GroupRequestRow,
    RequestRow,
    StepPlan,
    TierCopies,
)
from worker.step.group_tables import GroupTables
from worker.step.plan_check_groups import check_groups
from worker.step.plan_limits import Limits, PlanError, RowView, check_block_ids, leading_nulls


def check_row(row: RequestRow, limits: Limits, where: str) -> RowView:
    sid, n_blocks, n_tokens = row.seq_id, len(row.block_ids), len(row.token_ids)
    if n_blocks > limits.max_blocks_per_seq:
        raise PlanError(f"{where}: seq_id {sid} has {n_blocks} blocks, past max_blocks_per_seq {limits.max_blocks_per_seq}")
    ids = row.block_ids
    if limits.group_windows and limits.group_windows[0]:
        # NOTE: group 0 is a sliding group: a prefix-cache hit's blocks before the window are null.
        ids = ids[leading_nulls(ids) :]
    check_block_ids(ids, limits, f"{where}: seq_id {sid}")
    if n_tokens == 0:
        raise PlanError(f"{where}: seq_id {sid} has no tokens")
    if n_tokens > limits.max_model_len:
        raise PlanError(f"{where}: seq_id {sid} has {n_tokens} tokens, past max_model_len {limits.max_model_len}")
    if min(row.token_ids) < 0 or max(row.token_ids) >= limits.vocab_size:
        bad = next(t for t in row.token_ids if not 0 <= t < limits.vocab_size)
        raise PlanError(f"{where}: seq_id {sid} has token id {bad} outside the vocabulary of {limits.vocab_size}")
    computed = row.num_computed_tokens
    if not 0 <= computed <= n_tokens:
        raise PlanError(f"{where}: seq_id {sid} has num_computed_tokens {computed} outside 0..{n_tokens}")
    if computed > n_blocks * limits.block_size:
        raise PlanError(f"{where}: seq_id {sid} has {computed} computed tokens but {n_blocks} blocks hold {n_blocks * limits.block_size}")
    return (n_tokens, computed, n_blocks)


def check_tier_copies(tc: TierCopies, limits: Limits, where: str) -> None:
    """The offload tier's copies of a step: parallel lists of equal length, device ids
    in the cache (never the null block), host ids in the tier, and no target written
    twice in one direction (which copy would win?). A device block stored and loaded
    into in the same step is legal (stores run first), as is a host slot stored and
    loaded (the load reads what was just stored)."""
    where = f"{where} tier_copies"
    if limits.num_host_blocks == 0:
        raise PlanError(f"{where}: this worker has no host tier (WorkerReady num_host_blocks 0)")
    for kind, device_ids, host_ids in (("store", tc.store_device_ids, tc.store_host_ids), ("load", tc.load_device_ids, tc.load_host_ids)):
        if len(device_ids) != len(host_ids):
            raise PlanError(f"{where}: {len(device_ids)} {kind}_device_ids but {len(host_ids)} {kind}_host_ids")
        check_block_ids(device_ids, limits, f"{where} {kind}_device_ids")
        if host_ids and (min(host_ids) < 0 or max(host_ids) >= limits.num_host_blocks):
            bad = next(h for h in host_ids if not 0 <= h < limits.num_host_blocks)
            raise PlanError(f"{where}: {kind}_host_ids: host slot {bad} is outside the tier (valid slots 0..{limits.num_host_blocks - 1})")
    for field, targets in (("store_host_ids", tc.store_host_ids), ("load_device_ids", tc.load_device_ids)):
        if len(set(targets)) != len(targets):
            seen: set[int] = set()
            dup = next(t for t in targets if t in seen or seen.add(t))
            raise PlanError(f"{where}: {field} names {dup} twice: two copies into one target in one step")


def check_plan(
    plan: StepPlan,
    expected_step_id: int,
    live_seq_ids: Collection[int],
    row_view: Callable[[int], RowView],
    limits: Limits,
    tables: GroupTables,
) -> None:
    """Raise PlanError if ``plan`` cannot be applied to the live rows; change nothing.
    ``tables``: the worker's block tables, one per KV-cache group."""
    where = _check_step_id(plan.step_id, expected_step_id)
    if plan.tier_copies is not None:
        check_tier_copies(plan.tier_copies, limits, where)
    removed = _removed_seq_ids(plan, live_seq_ids, where)
    overlay: dict[int, RowView] = {}

    def exists(sid: int) -> bool:
        return sid in overlay or (sid in live_seq_ids and sid not in removed)

    def view(sid: int) -> RowView:
        return overlay[sid] if sid in overlay else row_view(sid)

    _overlay_rows(plan, overlay, exists, limits, where)
    _overlay_appended(plan, overlay, exists, view, limits, where)
    untouched = [sid for sid in live_seq_ids if sid not in removed and sid not in overlay]
    num_rows = len(untouched) + len(overlay)
    if num_rows > limits.max_num_seqs:
        raise PlanError(f"{where}: {num_rows} live rows, more than max_num_seqs {limits.max_num_seqs}")
    live_rows = (*untouched, *overlay)
    _check_scheduled(plan, live_rows, exists, view, limits, where)
    if limits.group_windows:
        check_groups(tables, limits, plan, live_rows, view, where)
    elif any(type(a) is not AppendedBlocks for a in plan.appended) or any(type(r) is GroupRequestRow for r in (*plan.new_rows, *plan.resumed_rows)):
        raise PlanError(f"{where}: hybrid KV-cache group deltas sent to a worker with one full-attention KV-cache group")


def _check_step_id(step: int, expected_step_id: int) -> str:
    """Plans come in step order, each once; the place to name in errors."""
    if step != expected_step_id:
        kind = "a repeat" if step < expected_step_id else "a gap"
        raise PlanError(f"step_id {step} is {kind}: expected step_id {expected_step_id}")
    return f"step {step}"


def _removed_seq_ids(plan: StepPlan, live_seq_ids: Collection[int], where: str) -> set[int]:
    """The finished and preempted rows: each live, and removed once."""
    removed: set[int] = set()
    for field, ids in (("finished_seq_ids", plan.finished_seq_ids), ("preempted_seq_ids", plan.preempted_seq_ids)):
        for sid in ids:
            if sid not in live_seq_ids:
                raise PlanError(f"{where}: unknown seq_id {sid} in {field}")
            if sid in removed:
                raise PlanError(f"{where}: seq_id {sid} is removed twice (finished_seq_ids/preempted_seq_ids)")
            removed.add(sid)
    return removed


def _overlay_rows(
    plan: StepPlan, overlay: dict[int, RowView], exists: Callable[[int], bool], limits: Limits, where: str
) -> None:
    """New rows (not live yet) and resumed rows (each once) into the overlay."""
    for row in plan.new_rows:
        if exists(row.seq_id):
            raise PlanError(f"{where}: new row seq_id {row.seq_id} is already live")
        overlay[row.seq_id] = check_row(row, limits, f"{where} new_rows")
    for row in plan.resumed_rows:
        if row.seq_id in overlay:
            raise PlanError(f"{where}: resumed row seq_id {row.seq_id} is sent twice in one plan")
        # NOTE: a resumed row replaces its live row whole, or comes back after its
        # preemption dropped it; either way it is live afterwards.
        overlay[row.seq_id] = check_row(row, limits, f"{where} resumed_rows")


def _overlay_appended(
    plan: StepPlan,
    overlay: dict[int, RowView],
    exists: Callable[[int], bool],
    view: Callable[[int], RowView],
    limits: Limits,
    where: str,
) -> None:
    """Group 0's appended block ids onto their rows in the overlay, within max_blocks_per_seq
    (the other groups' deltas are ``plan_check_groups``')."""
    for ap in plan.appended:
        if type(ap) is not AppendedBlocks:
            continue
        if not exists(ap.seq_id):
            raise PlanError(f"{where}: unknown seq_id {ap.seq_id} in appended")
        n_tokens, computed, n_blocks = view(ap.seq_id)
        check_block_ids(ap.block_ids, limits, f"{where} appended: seq_id {ap.seq_id}")
        n_blocks += len(ap.block_ids)
        if n_blocks > limits.max_blocks_per_seq:
            raise PlanError(f"{where}: appending to seq_id {ap.seq_id} makes {n_blocks} blocks, past max_blocks_per_seq {limits.max_blocks_per_seq}")
        overlay[ap.seq_id] = (n_tokens, computed, n_blocks)


def _check_scheduled(
    plan: StepPlan,
    live_rows: tuple[int, ...],
    exists: Callable[[int], bool],
    view: Callable[[int], RowView],
    limits: Limits,
    where: str,
) -> None:
    """Every scheduled row exists; every live row's scheduled tokens (1 unless named)
    exist and fit its blocks. A row with drafts has exactly one token not yet computed and
    is scheduled it and every draft, each draft a token of the vocabulary."""
    for sid, n in plan.num_scheduled_tokens.items():
        if not exists(sid):
            raise PlanError(f"{where}: unknown seq_id {sid} in num_scheduled_tokens")
        if n < 0:
            raise PlanError(f"{where}: seq_id {sid} has a negative number of scheduled tokens ({n})")
    scheduled = plan.num_scheduled_tokens
    spec = plan.spec_token_ids
    for sid, drafts in spec.items():
        if not exists(sid):
            raise PlanError(f"{where}: unknown seq_id {sid} in spec_token_ids")
        n_tokens, computed, _ = view(sid)
        if not drafts or computed != n_tokens - 1 or scheduled.get(sid, 1) != 1 + len(drafts):
            raise PlanError(f"{where}: seq_id {sid} has {len(drafts)} drafts: it must have one token not yet computed "
                            f"(has {n_tokens - computed}) and be scheduled it and every draft ({scheduled.get(sid, 1)} scheduled)")
        if min(drafts) < 0 or max(drafts) >= limits.vocab_size:
            bad = next(t for t in drafts if not 0 <= t < limits.vocab_size)
            raise PlanError(f"{where}: seq_id {sid} has draft token id {bad} outside the vocabulary of {limits.vocab_size}")
        if n_tokens + len(drafts) > limits.max_model_len:
            raise PlanError(f"{where}: seq_id {sid}'s drafts reach position {n_tokens + len(drafts) - 1}, past max_model_len {limits.max_model_len}")
    for sid in live_rows:
        n = scheduled.get(sid, 1)
        n_tokens, computed, n_blocks = view(sid)
        if spec and sid in spec:
            n_tokens += len(spec[sid])
        if computed + n > n_tokens:
            raise PlanError(f"{where}: seq_id {sid} is scheduled {n} tokens but has only {n_tokens - computed} not yet computed")
        if computed + n > n_blocks * limits.block_size:
            raise PlanError(f"{where}: seq_id {sid} is scheduled up to position {computed + n - 1} but its {n_blocks} blocks hold {n_blocks * limits.block_size} tokens")
