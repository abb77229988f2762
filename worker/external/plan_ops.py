"""Where a plan's external-tier ops meet the worker's process loop: before the plan runs,
after it, and in the hello of a new handshake."""

from __future__ import annotations

import logging

from protocol.worker_messages import StepPlan
from worker.external.external_io import ExternalIO
from worker.external.ops_check import check_external_ops

log = logging.getLogger("kvpool.worker.external")

# How long a new handshake waits for the external tier's saves and loads of the last scheduler.
DRAIN_S = 30.0


def before_step(io: ExternalIO | None, plan: StepPlan, num_blocks: int) -> bool:
    """Check the plan's ops (PlanError) and start its loads now if they may run beside its
    forward: their blocks are new to a parked request, which no row reads -- unless the plan
    has host-tier copies, which may store those blocks' old contents first. True if started."""
    ops = plan.external
    if ops is None:
        return False
    check_external_ops(ops, io, num_blocks)
    if not ops.load_ids or plan.tier_copies is not None:
        return False
    io.submit([], ops)
    return True


def after_step(io: ExternalIO | None, plan: StepPlan, loads_started: bool) -> None:
    """The plan ran: stage its saves (blocks it computed, read before any later plan) and
    queue them, with its loads unless `before_step` started them."""
    ops = plan.external
    if ops is not None:
        io.submit(io.stage(ops), None if loads_started else ops)


def hello_fields(io: ExternalIO | None) -> dict:
    """The tier in a WorkerHello: its name, identity and (a directory) its keys. Loads of an
    earlier scheduler are finished first and their news dropped: their ids mean nothing to
    the next one."""
    if io is None:
        return {}
    if not io.drain(DRAIN_S):
        log.warning("the external tier's queue did not drain in %g s", DRAIN_S)
    io.take_done()
    return dict(external_tier=io.store.name, external_identity=io.identity, external_keys=io.store.keys())
