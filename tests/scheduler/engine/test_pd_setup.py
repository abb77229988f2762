"""P/D disaggregation as the scheduler process sets it up (scheduler/engine/pd_setup.py): a
worker's hello is checked against ``--kv-transfer-config`` (both given the same one, a
producer's worker with a side channel), a hybrid model's as any other's, and the connector
knows the KV-cache groups it lends and reads."""

from __future__ import annotations

import pytest

from protocol.worker_messages import WorkerHello
from scheduler.engine.pd_setup import check_kv_transfer, make_pd_connector
from scheduler.engine.worker_checks import WorkerRefused

PRODUCER = '{"kv_connector": "KVPoolConnector", "kv_role": "kv_producer"}'


def hello(group_windows: list[int], address: str = "127.0.0.1:7001", identity: str = "ab" * 16) -> WorkerHello:
    return WorkerHello(0, 1, 64, 16, 512, 2, group_windows=group_windows, kv_transfer_address=address, kv_transfer_identity=identity)


@pytest.mark.parametrize("group_windows", [[], [0], [16, 16, 0]], ids=["one-group", "full", "hybrid"])
def test_a_worker_of_the_same_config_is_taken_hybrid_or_not(group_windows):
    check_kv_transfer(hello(group_windows), PRODUCER)
    assert make_pd_connector(PRODUCER, 16, group_windows or [0]).group_windows == (group_windows or [0])


@pytest.mark.parametrize(("worker", "config", "words"), [
    (hello([16, 0], identity=""), PRODUCER, "this scheduler has a --kv-transfer-config, the worker has none"),
    (hello([16, 0], address=""), PRODUCER, "the worker lends no KV"),
    (hello([16, 0]), None, "the worker has a --kv-transfer-config, this scheduler has none"),
], ids=["no-identity", "no-side-channel", "no-config"])
def test_a_worker_of_another_config_is_refused(worker, config, words):
    with pytest.raises(WorkerRefused, match=words):
        check_kv_transfer(worker, config)


def test_without_a_config_there_is_no_connector():
    assert make_pd_connector(None, 16, [16, 0]) is None
