"""Every field of vLLM 0.32's request classes has an answer in kvpool
(``frontend.schema.request_fields``): the table covers exactly vLLM's fields per endpoint (the
list is vLLM's own, ``data/vllm_request_fields_0.32.txt``), an honoured field is one the
request classes declare, and a live frontend refuses each refused field by name with a
400 (vLLM's words where vLLM refuses it too), accepts the values under which vLLM
behaves as kvpool does, and forwards nothing for a refused request."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from kvtest.fake_engine import fake_engine, frontend_process
from kvtest.http_api import post

from frontend.schema.request_fields import (
    FIELDS,
    HONOURED,
    NO_EFFECT,
    REFUSED,
    UnhonouredFields,
    fields_doc,
)
from frontend.schema.requests import ChatCompletionRequest, CompletionRequest

DATA = Path(__file__).parents[1] / "data" / "vllm_request_fields_0.32.txt"
REPO = Path(__file__).resolve().parents[3]


def vllm_fields() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {"completion": [], "chat": []}
    for line in DATA.read_text().splitlines():
        if line and not line.startswith("#"):
            endpoint, name = line.split("\t")
            out[endpoint].append(name)
    return out


def test_the_table_has_every_vllm_field_on_its_endpoints_and_no_other():
    vllm = vllm_fields()
    assert len(vllm["completion"]) == 55 and len(vllm["chat"]) == 68
    for endpoint, names in vllm.items():
        ours = {n for n, f in FIELDS.items() if endpoint in f.endpoints}
        assert ours == set(names), (endpoint, sorted(ours ^ set(names)))
    assert {f.status for f in FIELDS.values()} == {HONOURED, NO_EFFECT, REFUSED}


@pytest.mark.parametrize("endpoint", ["completion", "chat"])
def test_every_field_is_declared_so_none_is_dropped_unread(endpoint):
    cls = CompletionRequest if endpoint == "completion" else ChatCompletionRequest
    # NOTE: a field may be read through a property over a raw one (add_generation_prompt:
    # vLLM's checks read whether the client sent it).
    declared = set(cls.__struct_fields__) | {n for n in dir(cls) if isinstance(getattr(cls, n, None), property)}
    missing = [n for n, f in FIELDS.items() if endpoint in f.endpoints and n not in declared]
    assert not missing, f"{endpoint}: vLLM fields the request class would drop unread: {missing}"


def test_the_unhonoured_fields_default_to_vllms_defaults():
    # vLLM 0.32's defaults, read from its protocol classes (the data file's generator prints them too).
    d = UnhonouredFields()
    assert (d.use_beam_search, d.length_penalty, d.include_reasoning, d.mm_payload, d.routed_experts_prompt_start) == (
        False, 1.0, True, "tensors", 0)
    assert d.return_token_offsets is False and d.stream_interval is None and d.watermarking is None


def test_the_doc_is_the_table():
    assert (REPO / "docs" / "vllm-request-fields.md").read_text() == fields_doc(), (
        "run: python -c 'from frontend.schema.request_fields import fields_doc; print(fields_doc(), end=\"\")' > docs/vllm-request-fields.md")


@pytest.fixture(scope="module")
def front(tiny_checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("fields") / "frontend.log"
    with fake_engine() as engine, frontend_process(tiny_checkpoint, engine, log) as f:
        f.engine = engine
        yield f


BODIES = {"completion": ("/v1/completions", {"prompt": "hello there", "max_tokens": 2}),
          "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})}

REFUSALS = [
    ("use_beam_search", True, "use_beam_search is not supported by kvpool"),
    ("thinking_token_budget", 8, "thinking_token_budget is set but reasoning_config is not configured"),
    ("logprob_token_ids", [3, 4], "logprob_token_ids is not supported by kvpool"),
    ("repetition_detection", {"max_pattern_size": 4, "min_count": 3}, "repetition_detection is not supported by kvpool"),
    ("stream_interval", 4, "stream_interval above 1 is not supported by kvpool"),
]


@pytest.mark.parametrize("endpoint", ["completion", "chat"])
@pytest.mark.parametrize(("field", "value", "message"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_a_refused_field_is_a_400_naming_it_and_nothing_reaches_the_engine(front, endpoint, field, value, message):
    path, body = BODIES[endpoint]
    before = len(front.engine.generated)
    status, answer = post(front, path, {**body, field: value})
    assert status == 400, answer
    assert message in answer["error"]["message"] and answer["error"]["param"] == field
    assert len(front.engine.generated) == before


@pytest.mark.parametrize(("endpoint", "field", "value", "message"), [
    ("completion", "prompt_embeds", "AAAA", "prompt_embeds is not supported by kvpool"),
    ("chat", "return_prompt_text", True, "return_prompt_text is not supported by kvpool"),
])
def test_an_endpoint_only_refusal(front, endpoint, field, value, message):
    path, body = BODIES[endpoint]
    status, answer = post(front, path, {**body, field: value})
    assert status == 400 and message in answer["error"]["message"] and answer["error"]["param"] == field
    # The other endpoint's vLLM class has no such field: ignored there, as vLLM ignores it.
    other = "chat" if endpoint == "completion" else "completion"
    path, body = BODIES[other]
    assert post(front, path, {**body, field: value})[0] == 200


ACCEPTED = [
    ("use_beam_search", False), ("thinking_token_budget", -1), ("stream_interval", 1), ("watermarking", True),
    ("length_penalty", 0.5), ("include_reasoning", False), ("session_id", "s-1"), ("return_token_offsets", True),
    ("mm_payload", "none"), ("kv_transfer_params", {"do_remote_prefill": False}), ("vllm_xargs", {"k": 1}),
    ("user", "u"), ("routed_experts_prompt_start", 1),
]


@pytest.mark.parametrize("endpoint", ["completion", "chat"])
@pytest.mark.parametrize(("field", "value"), ACCEPTED, ids=[a[0] for a in ACCEPTED])
def test_values_under_which_vllm_behaves_as_kvpool_are_served(front, endpoint, field, value):
    path, body = BODIES[endpoint]
    status, answer = post(front, path, {**body, field: value})
    assert status == 200, answer
    assert answer["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("endpoint", ["completion", "chat"])
def test_no_effect_fields_are_still_type_and_range_checked_as_vllm(front, endpoint):
    path, body = BODIES[endpoint]
    status, answer = post(front, path, {**body, "watermarking": "yes"})
    assert status == 400 and "watermarking" in answer["error"]["message"]
    # vLLM: 0 <= routed_experts_prompt_start <= the prompt's length.
    status, answer = post(front, path, {**body, "routed_experts_prompt_start": 10_000})
    assert status == 400 and answer["error"]["param"] == "routed_experts_prompt_start"
    assert "must be between 0 and the prompt length" in answer["error"]["message"]


def test_decoding_keeps_a_no_effect_field_value():
    # Declared, so read: the check sees what the client sent, not a default.
    req = msgspec.json.decode(b'{"prompt": "x", "session_id": "abc", "length_penalty": 2.0}', type=CompletionRequest)
    assert req.session_id == "abc" and req.length_penalty == 2.0
