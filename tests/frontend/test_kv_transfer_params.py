"""A request's ``kv_transfer_params`` (P/D disaggregation, as vllm-router's PD mode
sends them) through a live API server and a fake scheduler: with --kv-transfer-config
they are checked (a 400 naming the key) and reach the engine in the Generate; without
it they are ignored, unchecked, as vLLM ignores them without a KV connector. A
finished request's params come back as the answer's top-level ``kv_transfer_params``
when it is not streamed, and not in a stream (vLLM 0.32's stream chunks have no such
field)."""

from __future__ import annotations

import pytest
from kvtest.fake_engine import fake_engine, frontend_process
from kvtest.http_api import post, post_stream

from protocol.kv_transfer_params import KVTransferParams

NIXL = '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}'
BODIES = {"completion": ("/v1/completions", {"prompt": "hello there", "max_tokens": 2}),
          "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})}
# vllm-router's PD mode, to the prefill engine: one token, not streamed, SGLang's extras.
PREFILL = {"kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                  "remote_block_ids": None, "remote_host": None, "remote_port": None},
           "max_tokens": 1, "min_tokens": 1, "stream": False, "no_stop_trim": True, "separate_reasoning": True,
           "stream_reasoning": False, "return_hidden_states": False, "include_reasoning": True}
# What a prefill engine answers, which the router sends on to the decode engine.
ANSWER = {"do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": "prefill-0", "remote_request_id": "cmpl-1-0-ab",
          "remote_host": "10.0.0.7", "remote_port": 5600, "remote_block_ids": [4, 7, 8], "remote_num_tokens": 40, "tp_size": 1}


@pytest.fixture(scope="module")
def connected(tiny_checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("kv-transfer") / "frontend.log"
    with fake_engine() as engine, frontend_process(tiny_checkpoint, engine, log, "--kv-transfer-config", NIXL) as f:
        f.engine = engine
        yield f


@pytest.fixture(scope="module")
def plain(tiny_checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("no-kv-transfer") / "frontend.log"
    with fake_engine() as engine, frontend_process(tiny_checkpoint, engine, log) as f:
        f.engine = engine
        yield f


@pytest.fixture
def answering(connected):
    connected.engine.kv_transfer_params = ANSWER
    yield connected
    connected.engine.kv_transfer_params = None


@pytest.mark.parametrize("endpoint", ["completion", "chat"])
@pytest.mark.parametrize(("params", "key"), [
    ({"do_remote_decode": True, "remote_port": "abc"}, "kv_transfer_params.remote_port"),
    ({"do_remote_prefill": True, "remote_engine_id": "e"}, "kv_transfer_params.remote_request_id"),
    ({"do_remote_decode": "yes"}, "kv_transfer_params.do_remote_decode"),
    ({"remote_block_ids": [1, -2]}, "kv_transfer_params.remote_block_ids"),
    ({"remote_block_ids": [[1], 2]}, "kv_transfer_params.remote_block_ids"),
    ({**ANSWER, "tp_size": 2}, "kv_transfer_params.tp_size"),
], ids=["port", "missing-key", "bool", "block-ids", "block-id-groups", "tp"])
def test_with_a_connector_bad_params_are_a_400_naming_the_key_and_reach_nothing(connected, endpoint, params, key):
    path, body = BODIES[endpoint]
    before = len(connected.engine.generated)
    status, answer = post(connected, path, {**body, "kv_transfer_params": params})
    assert status == 400, answer
    error = answer["error"]
    assert error["type"] == "BadRequestError" and error["param"] == "kv_transfer_params" and key in error["message"], error
    assert len(connected.engine.generated) == before


@pytest.mark.parametrize("endpoint", ["completion", "chat"])
def test_without_a_connector_they_are_ignored_unchecked_as_vllm(plain, endpoint):
    path, body = BODIES[endpoint]
    status, answer = post(plain, path, {**body, "kv_transfer_params": {"do_remote_decode": True, "remote_port": "abc"}})
    assert status == 200, answer
    assert plain.engine.generated[-1].kv_transfer_params is None and answer["kv_transfer_params"] is None


@pytest.mark.parametrize("endpoint", ["completion", "chat"])
def test_a_prefill_request_carries_its_checked_params_to_the_engine(connected, endpoint):
    path, body = BODIES[endpoint]
    status, answer = post(connected, path, {**body, **PREFILL})
    assert status == 200, answer
    generate = connected.engine.generated[-1]
    assert generate.kv_transfer_params == KVTransferParams(do_remote_decode=True)
    assert (generate.max_tokens, generate.min_tokens) == (1, 1)


@pytest.mark.parametrize("endpoint", ["completion", "chat"])
def test_a_decode_request_carries_the_prefills_answer_to_the_engine(connected, endpoint):
    path, body = BODIES[endpoint]
    # NOTE: vLLM 0.32 gives one list of block ids per KV-cache group; older vLLMs a flat list (one group's).
    for ids in ([[4, 7, 8]], [4, 7, 8], [[4, 7, 8], [6]]):
        status, answer = post(connected, path, {**body, "kv_transfer_params": {**ANSWER, "remote_block_ids": ids}})
        assert status == 200, answer
        groups = ids if isinstance(ids[0], list) else [ids]
        assert connected.engine.generated[-1].kv_transfer_params == KVTransferParams(**{**ANSWER, "remote_block_ids": groups})


def test_empty_params_are_none_as_vllm_passes_on_only_a_nonempty_dict(connected):
    path, body = BODIES["completion"]
    assert post(connected, path, {**body, "kv_transfer_params": {}})[0] == 200
    assert connected.engine.generated[-1].kv_transfer_params is None


@pytest.mark.parametrize("endpoint", ["completion", "chat"])
def test_the_finished_requests_params_are_the_answers(answering, endpoint):
    path, body = BODIES[endpoint]
    status, answer = post(answering, path, {**body, **PREFILL})
    assert status == 200, answer
    assert answer["kv_transfer_params"] == ANSWER
    # NOTE: as vLLM, the answer's, once: not a choice's.
    assert all("kv_transfer_params" not in c for c in answer["choices"])


@pytest.mark.parametrize("endpoint", ["completion", "chat"])
def test_a_stream_carries_none_as_vllms(answering, endpoint):
    path, body = BODIES[endpoint]
    events = post_stream(answering, path, {**body, "stream": True, "kv_transfer_params": ANSWER})
    assert events and not any("kv_transfer_params" in e for e in events)


def test_render_gives_the_params_as_the_request_gave_them_as_vllm(connected):
    params = {**ANSWER, "remote_block_ids": [[4, 7, 8]]}
    status, answer = post(connected, "/v1/completions/render", {"prompt": "hello", "max_tokens": 2, "kv_transfer_params": params})
    assert status == 200, answer
    assert answer[0]["kv_transfer_params"] == params and "kv_transfer_params" not in answer[0]["sampling_params"]
