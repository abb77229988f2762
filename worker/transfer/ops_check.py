"""The checks of a plan's P/D disaggregation ops (``KVTransferOps``), before anything of the plan is applied."""

from __future__ import annotations

from protocol.tcp_address import split_address
from protocol.worker_messages import KVTransferOps
from worker.step.plan_check import PlanError
from worker.transfer.kv_transfer import KVTransfer


def check_transfer_ops(ops: KVTransferOps, transfer: KVTransfer | None, num_blocks: int) -> None:
    """PlanError unless this worker's role allows the ops (lends: a producer; pulls: a
    consumer) and every list is well formed: parallel lists of equal length, unique ids,
    local block ids of the pool (1..num_blocks-1, never the null block), no device block
    pulled into twice, as many remote blocks (over every KV-cache group's list) as local
    ones, addresses ``host:port``."""
    if transfer is None:
        raise PlanError("the plan lends or pulls KV blocks, but this worker has no --kv-transfer-config")
    lends = bool(ops.lend_ids or ops.lend_block_ids or ops.unlend_ids)
    pulls = bool(ops.pull_ids or ops.pull_addresses or ops.pull_request_ids or ops.pull_remote_block_ids or ops.pull_block_ids)
    if lends:
        if transfer.server is None:
            raise PlanError("the plan lends KV blocks, but this worker's kv_role is not kv_producer or kv_both")
        _check_lends(ops, num_blocks)
    if pulls:
        if transfer.puller is None:
            raise PlanError("the plan pulls KV blocks, but this worker's kv_role is not kv_consumer or kv_both")
        _check_pulls(ops, num_blocks)


def _check_lends(ops: KVTransferOps, num_blocks: int) -> None:
    if len(ops.lend_ids) != len(ops.lend_block_ids):
        raise PlanError(f"KV lends: {len(ops.lend_ids)} ids for {len(ops.lend_block_ids)} block lists")
    if len(set(ops.lend_ids)) != len(ops.lend_ids):
        raise PlanError(f"KV lends: an id repeats in {ops.lend_ids}")
    for request_id, groups in zip(ops.lend_ids, ops.lend_block_ids, strict=True):
        if not any(groups):
            raise PlanError(f"KV lend {request_id!r}: no blocks")
        for block_ids in groups:
            _check_ids(block_ids, num_blocks, f"KV lend {request_id!r}")


def _check_pulls(ops: KVTransferOps, num_blocks: int) -> None:
    lists = (ops.pull_ids, ops.pull_addresses, ops.pull_request_ids, ops.pull_remote_block_ids, ops.pull_block_ids)
    if len({len(x) for x in lists}) != 1:
        raise PlanError(f"KV pulls: {', '.join(str(len(x)) for x in lists)} ids, addresses, request ids, remote and local block lists")
    if len(set(ops.pull_ids)) != len(ops.pull_ids):
        raise PlanError(f"KV pulls: an id repeats in {ops.pull_ids}")
    targets: set[int] = set()
    for pull_id, address, remote_groups, local in zip(ops.pull_ids, ops.pull_addresses, ops.pull_remote_block_ids, ops.pull_block_ids,
                                                      strict=True):
        remote = [b for group in remote_groups for b in group]
        if len(remote) != len(local) or not local:
            raise PlanError(f"KV pull {pull_id}: {len(remote)} remote blocks for {len(local)} local ones")
        if any(b < 1 for b in remote):
            raise PlanError(f"KV pull {pull_id}: a remote block id below 1 in {remote}")
        _check_ids(local, num_blocks, f"KV pull {pull_id}")
        targets.update(local)
        try:
            split_address(address, f"KV pull {pull_id}: address")
        except ValueError as e:
            raise PlanError(str(e)) from None
    if len(targets) != sum(len(b) for b in ops.pull_block_ids):
        raise PlanError("KV pulls: a device block is pulled into twice")


def _check_ids(block_ids: list[int], num_blocks: int, what: str) -> None:
    for b in block_ids:
        if not 1 <= b < num_blocks:
            raise PlanError(f"{what}: block id {b} is outside 1..{num_blocks - 1}")
