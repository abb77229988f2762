"""Where a plan's P/D disaggregation ops meet the worker's process loop: before the plan
runs, after it, and in the hello of a new handshake."""

from __future__ import annotations

from protocol.worker_messages import StepPlan
from worker.transfer.kv_transfer import KVTransfer
from worker.transfer.ops_check import check_transfer_ops

# How long a new handshake waits for the pulls of the last scheduler.
DRAIN_S = 30.0


def before_step(transfer: KVTransfer | None, plan: StepPlan, num_blocks: int) -> bool:
    """Check the plan's ops (PlanError, nothing applied), apply its unlends then its lends
    (before the forward, which may reuse an unlent block), and start its pulls now if they
    may run beside the forward: their blocks are new to a parked request, which no row
    reads -- unless the plan has host-tier copies, which may store those blocks' old
    contents first. True if the pulls started."""
    ops = plan.kv_transfer
    if ops is None:
        return False
    check_transfer_ops(ops, transfer, num_blocks)
    transfer.apply_lends(ops)
    if not ops.pull_ids or plan.tier_copies is not None:
        return False
    transfer.start_pulls(ops)
    return True


def after_step(transfer: KVTransfer | None, plan: StepPlan, pulls_started: bool) -> None:
    """The plan ran: start its pulls unless `before_step` did."""
    ops = plan.kv_transfer
    if ops is not None and ops.pull_ids and not pulls_started:
        transfer.start_pulls(ops)


def hello_fields(transfer: KVTransfer | None) -> dict:
    """P/D disaggregation in a WorkerHello: the address lent blocks are read at ("" for a
    consumer only) and the identity of this worker's KV. Lends of an earlier scheduler are
    taken back and its pulls finished first, their news dropped: their ids mean nothing to
    the next one."""
    if transfer is None:
        return {}
    transfer.reset(DRAIN_S)
    address = "" if transfer.server is None else transfer.server.address
    return dict(kv_transfer_address=address, kv_transfer_identity=transfer.identity)
