"""``kvpool serve --kv-transfer-config JSON`` (vLLM's KVTransferConfig, P/D
disaggregation): checked once, before anything starts, and given to the scheduler, the
worker and the API server as the same JSON, so all three name one engine_id; refused
by name where kvpool cannot serve it. Nothing is started: parse_serve and
Launcher.build only (the children's own parsers are tested with them)."""

from __future__ import annotations

import json

import pytest

from frontend.config import config_from_args
from frontend.serve import launcher
from frontend.serve.cli import main, parse_serve
from protocol.kv_transfer_config import parse_kv_transfer_config

NIXL = '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}'
CHILDREN = ("scheduler", "worker", "frontend")


def argvs(*argv: str) -> dict[str, list[str]]:
    la = launcher.Launcher(parse_serve(["serve", "m", *argv]), log=lambda *a, **k: None)
    la.build()
    return {name: c.argv for name, c in la.children.items()}


def given_config(argv: list[str]) -> str:
    assert argv.count("--kv-transfer-config") == 1, argv
    return argv[argv.index("--kv-transfer-config") + 1]


def test_every_child_gets_the_checked_config_with_one_engine_id():
    # As vLLM's NixlConnector deployments give it: no engine_id, so a fresh uuid.
    c = argvs("--kv-transfer-config", NIXL)
    texts = {name: given_config(c[name]) for name in CHILDREN}
    assert len(set(texts.values())) == 1, texts
    config = parse_kv_transfer_config(texts["scheduler"])
    assert (config.kv_connector, config.kv_role) == ("NixlConnector", "kv_both") and config.engine_id
    # Read back, it is itself: no child makes an engine_id of its own.
    assert parse_kv_transfer_config(config.to_json()) == config


def test_a_given_engine_id_and_extra_config_reach_every_child():
    text = json.dumps({"kv_connector": "KVPoolConnector", "kv_role": "kv_producer", "engine_id": "prefill-0",
                       "kv_connector_extra_config": {"kv_lease_duration": 5, "side_channel_port": 5600}})
    c = argvs("--kv-transfer-config", text)
    for name in CHILDREN:
        config = parse_kv_transfer_config(given_config(c[name]))
        assert (config.engine_id, config.kv_lease_duration, config.side_channel_port) == ("prefill-0", 5.0, 5600), name


def test_vllms_dotted_spelling_is_one_config():
    c = argvs("--kv-transfer-config.kv_connector", "NixlConnector", "--kv-transfer-config.kv_role", "kv_consumer")
    assert parse_kv_transfer_config(given_config(c["worker"])).kv_role == "kv_consumer"


def test_without_the_flag_no_child_gets_it():
    c = argvs()
    assert not any("--kv-transfer-config" in c[name] for name in CHILDREN)


def test_the_api_servers_config_reads_what_serve_gives_it():
    argv = argvs("--kv-transfer-config", NIXL)["frontend"]
    config = config_from_args(argv[3:])  # after: python -m frontend
    assert config.kv_transfer_config == parse_kv_transfer_config(given_config(argv))


def test_the_api_server_alone_refuses_a_bad_config_by_name(capsys):
    with pytest.raises(SystemExit):
        config_from_args(["--model", "m", "--kv-transfer-config", '{"kv_connector": "NixlConnector", "kv_role": "both"}'])
    assert "--kv-transfer-config: kv_role 'both' is not one of" in capsys.readouterr().err
    assert config_from_args(["--model", "m"]).kv_transfer_config is None


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--kv-transfer-config", "{"], "kvpool serve: --kv-transfer-config is not JSON: "),
        (["--kv-transfer-config", '{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}'],
         "kvpool serve: --kv-transfer-config: kv_connector 'LMCacheConnectorV1' is not supported by kvpool"),
        (["--kv-transfer-config", NIXL, "--kv-offloading-backend", "disk", "--kv-offloading-path", "/tmp/kv",
          "--kv-offloading-disk-size", "1"],
         "kvpool serve: --kv-transfer-config with --kv-offloading-backend disk: not supported together yet"),
        (["--kv-transfer-config", NIXL, "--kv-offloading-backend", "mooncake", "--mooncake-master", "h:1",
          "--mooncake-metadata", "http://h:2/metadata"],
         "kvpool serve: --kv-transfer-config with --kv-offloading-backend mooncake: not supported together yet"),
        (["--kv-transfer-config", NIXL, "--tensor-parallel-size", "2"],
         "kvpool serve: --kv-transfer-config with --tensor-parallel-size 2: not supported yet"),
    ],
    ids=["not-json", "other-connector", "disk", "mooncake", "tp"],
)
def test_what_kvpool_cannot_serve_is_refused_in_one_line_before_anything_starts(monkeypatch, capsys, argv, line):
    monkeypatch.setattr(launcher, "main_serve", lambda a: pytest.fail("a refused --kv-transfer-config reached main_serve"))
    assert main(["serve", "m", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(line) and err.count("\n") == 1, err


def test_the_host_tier_goes_with_it(monkeypatch):
    started = []
    monkeypatch.setattr(launcher, "main_serve", lambda a: started.append(a) or 0)
    assert main(["serve", "m", "--kv-transfer-config", NIXL, "--kv-offloading-size", "1", "--kv-offloading-backend", "native"]) == 0
    assert len(started) == 1
