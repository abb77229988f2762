"""The checks of a plan's external-tier ops (``ExternalKVOps``), before anything of the plan is applied."""

from __future__ import annotations

from protocol.worker_messages import ExternalKVOps
from worker.external.external_io import ExternalIO
from worker.step.plan_check import PlanError


def check_external_ops(ops: ExternalKVOps, external: ExternalIO | None, num_blocks: int) -> None:
    """PlanError unless this worker has an external tier and every list of ``ops`` is
    well formed: parallel lists of equal length, block ids of the pool (1..num_blocks-1,
    never the null block), no device block loaded twice."""
    if external is None:
        raise PlanError("the plan saves or loads external KV, but this worker has no external tier (--kv-offloading-backend)")
    if len(ops.save_block_ids) != len(ops.save_keys):
        raise PlanError(f"external saves: {len(ops.save_block_ids)} blocks for {len(ops.save_keys)} keys")
    if not len(ops.load_ids) == len(ops.load_keys) == len(ops.load_block_ids):
        raise PlanError(f"external loads: {len(ops.load_ids)} ids, {len(ops.load_keys)} key lists, {len(ops.load_block_ids)} block lists")
    if len(set(ops.load_ids)) != len(ops.load_ids):
        raise PlanError(f"external loads: an id repeats in {ops.load_ids}")
    targets: set[int] = set()
    for load_id, keys, block_ids in zip(ops.load_ids, ops.load_keys, ops.load_block_ids, strict=True):
        if len(keys) != len(block_ids) or not keys:
            raise PlanError(f"external load {load_id}: {len(keys)} keys for {len(block_ids)} blocks")
        targets.update(block_ids)
        _check_ids(block_ids, num_blocks, f"external load {load_id}")
    if len(targets) != sum(len(b) for b in ops.load_block_ids):
        raise PlanError("external loads: a device block is loaded twice")
    _check_ids(ops.save_block_ids, num_blocks, "external saves")


def _check_ids(block_ids: list[int], num_blocks: int, what: str) -> None:
    for b in block_ids:
        if not 1 <= b < num_blocks:
            raise PlanError(f"{what}: block id {b} is outside 1..{num_blocks - 1}")
