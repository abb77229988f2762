"""P/D disaggregation as the scheduler process sets it up: the connector of its
``--kv-transfer-config``, and each worker's hello checked against it (the worker moves
the blocks; both must be given the same config)."""

from __future__ import annotations

from collections.abc import Sequence

from protocol.kv_transfer_config import parse_kv_transfer_config
from protocol.worker_messages import WorkerHello
from scheduler.engine.worker_checks import WorkerRefused
from scheduler.sched.pd_connector import PDConnector


def make_pd_connector(kv_transfer_config: str | None, block_size: int, group_windows: Sequence[int]) -> PDConnector | None:
    """The connector of ``--kv-transfer-config`` (None: off), for KV-cache groups of ``group_windows``."""
    if kv_transfer_config is None:
        return None
    return PDConnector(parse_kv_transfer_config(kv_transfer_config), block_size, group_windows=group_windows)


def check_kv_transfer(hello: WorkerHello, kv_transfer_config: str | None) -> None:
    """WorkerRefused unless the worker moves KV as this scheduler's config says."""
    if kv_transfer_config is None:
        if hello.kv_transfer_address or hello.kv_transfer_identity:
            raise WorkerRefused("the worker has a --kv-transfer-config, this scheduler has none: give both the same one")
        return
    config = parse_kv_transfer_config(kv_transfer_config)
    if not hello.kv_transfer_identity:
        raise WorkerRefused("this scheduler has a --kv-transfer-config, the worker has none: give both the same one")
    if config.is_producer and not hello.kv_transfer_address:
        raise WorkerRefused(f"this scheduler's kv_role is {config.kv_role}, but the worker lends no KV (no side channel): "
                            "give both the same --kv-transfer-config")
