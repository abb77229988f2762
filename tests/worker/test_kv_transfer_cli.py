"""``python -m worker --kv-transfer-config JSON`` (worker/__main__.py): a good config reaches
WorkerConfig; a bad one, or one with what P/D disaggregation does not work with yet (tensor
parallelism, an external tier), exits 2 naming the problem."""

from __future__ import annotations

import json

import pytest

from worker.__main__ import config_from_args

CPU = ["--device", "cpu"]


def flag(**config) -> list[str]:
    return ["--kv-transfer-config", json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_producer", **config})]


def test_the_kv_transfer_config_reaches_the_worker_config():
    c = config_from_args([*CPU, *flag(engine_id="p0", kv_connector_extra_config={"side_channel_port": 5600, "read_timeout": 2})])
    t = c.kv_transfer
    assert (t.kv_role, t.engine_id, t.side_channel_host, t.side_channel_port, t.read_timeout) == ("kv_producer", "p0", "127.0.0.1", 5600, 2.0)
    assert t.is_producer and not t.is_consumer
    assert config_from_args(CPU).kv_transfer is None


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--kv-transfer-config", "{"], "--kv-transfer-config is not JSON"),
        (flag(kv_role="kv_reader"), "kv_role 'kv_reader' is not one of kv_producer, kv_consumer, kv_both"),
        (flag(kv_connector_extra_config={"side_channel_port": 70000}), "side_channel_port must be a port"),
        ([*flag(), "--tensor-parallel-size", "2"], "--kv-transfer-config: not with tensor parallelism yet"),
        ([*flag(), "--kv-offloading-backend", "disk", "--kv-offloading-path", "/tmp/x", "--kv-offloading-disk-size", "1"],
         "--kv-transfer-config: not with --kv-offloading-backend disk yet"),
    ],
    ids=["not-json", "bad-role", "bad-port", "tp2", "disk"],
)
def test_a_bad_kv_transfer_config_exits_2_naming_it(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        config_from_args([*CPU, *argv])
    assert e.value.code == 2
    assert words in " ".join(capsys.readouterr().err.split())
