"""Schemathesis against a live `kvpool serve`: inputs generated from the server's own
``/openapi.json`` (vLLM 0.32's schema, frontend/routes/openapi.py) at every operation in it,
valid and not (its coverage phase: missing fields, wrong types, edge values; then its
fuzzing phase), a string ``model`` set to the served name so they reach rendering and
the engine. No answer may be a server error, every refusal is OpenAI's error object with a
message, every answer comes within a bounded time, and afterwards the server still
completes a normal request.

A 501 is allowed only as vLLM's own refusal of a feature (its schema lists 501 for
chat and tokenize): an OpenAI error object of type NotImplementedError saying what is
missing (kvpool: LoRA, ``reset_prefix_cache``'s ``reset_running_requests``). Every
route in the schema is on: dev mode, runtime LoRA updating, ``/tokenizer_info``.
"""

from __future__ import annotations

import json
import urllib.request
from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from kvtest.http_api import post
from kvtest.serve import kvpool_serve
from schemathesis.checks import not_a_server_error

from frontend.routes.openapi import DATA

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MAX_EXAMPLES = 15  # per operation and phase: what keeps the run short
REQUEST_TIMEOUT_S = 30  # a case that gets no answer this long is a hang
CONFIG = schemathesis.Config.from_dict({
    "request-timeout": REQUEST_TIMEOUT_S,
    "generation": {"max-examples": MAX_EXAMPLES, "database": "none"},
    "phases": {"stateful": {"enabled": False}},
    # NOTE: the render routes decode and render as /v1/completions and /v1/chat/completions do
    # (frontend/openai/render.py): their coverage cases would repeat those; they keep the fuzzing phase.
    "operations": [{"include-path-regex": "/render$", "phases": {"coverage": {"enabled": False}}}],
})
MODEL = "fuzz"
CASES: Counter[str] = Counter()  # operation -> cases sent


@pytest.fixture(scope="module")
def served(tiny_checkpoint, tmp_path_factory):
    flags = ("--served-model-name", MODEL, "--max-model-len", "512", "--dev-mode", "--enable-tokenizer-info-endpoint")
    with kvpool_serve(tiny_checkpoint, tmp_path_factory.mktemp("fuzz-logs"), *flags,
                      env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}) as s:
        yield s


# NOTE: the committed schema with every route on, which the server must serve as it is
# (test_the_schema_is_what_the_server_serves); loaded here, not from the server, because
# schemathesis' lazy loader (from_fixture) breaks on pytest 9.
schema = schemathesis.openapi.from_dict(json.loads(DATA.read_text())["schema"], config=CONFIG)


def test_the_schema_is_what_the_server_serves(served):
    with urllib.request.urlopen(served.base_url + "/openapi.json", timeout=30) as r:
        assert json.loads(r.read()) == schema.raw_schema


def an_error_object(response) -> str | None:
    """What is wrong with a 4xx/5xx answer that is not OpenAI's error object naming the problem."""
    try:
        error = json.loads(response.content)["error"]
        message, code = error["message"], error["code"]
    except (ValueError, KeyError, TypeError):
        return f"not an error object: {response.content[:200]!r}"
    return None if isinstance(message, str) and message and code == response.status_code else f"a bad error object: {error}"


def a_refused_feature(response) -> bool:
    """A 501 that is an explicit refusal of a feature kvpool lacks, not a failure."""
    try:
        error = json.loads(response.content)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return response.status_code == 501 and error.get("type") == "NotImplementedError" and bool(error.get("message"))


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck))
def test_no_generated_input_is_a_server_error_or_a_hang(case, served):
    if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
        case.body["model"] = MODEL  # NOTE: past the model check (a random name is a 404), into rendering and the engine
    response = case.call(base_url=served.base_url, timeout=REQUEST_TIMEOUT_S)  # raises on a hang
    CASES[case.operation.label] += 1
    if not a_refused_feature(response):
        case.validate_response(response, checks=[not_a_server_error])
    if response.status_code >= 400:
        assert an_error_object(response) is None, (an_error_object(response), case.as_curl_command())


def test_the_server_still_serves_after_the_fuzzing(served):
    paths = schema.raw_schema["paths"]
    assert set(CASES) == {f"{method.upper()} {path}" for path, item in paths.items() for method in item}  # every operation fuzzed
    status, body = post(served, "/v1/completions", {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3,
                                                    "ignore_eos": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 3
    print(f"\nschemathesis sent {sum(CASES.values())} cases to {len(CASES)} operations: {dict(CASES)}")

