"""POST /invocations (SageMaker) as vLLM 0.32 routes it (checked against `vllm serve`):
a chat-shaped body is a chat completion, any other JSON object a completion (refused
by the completion endpoint's own checks when it is none), anything else "Cannot find
suitable handler"; only application/json. A real `python -m frontend` on a fake
scheduler, with --response-role so a chat answer is told from a completion."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from kvtest.fake_engine import fake_engine, frontend_process


@pytest.fixture(scope="module")
def front(tiny_checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("sagemaker") / "frontend.log"
    with fake_engine() as engine, frontend_process(tiny_checkpoint, engine, log, "--response-role", "bot", "--api-key", "k") as f:
        yield f


def invoke(front, body: bytes, content_type: str = "application/json"):
    req = urllib.request.Request(front.base_url + "/invocations", data=body, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_chat_body_is_a_chat_completion(front):
    status, body = invoke(front, json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}).encode())
    assert status == 200 and body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "bot"
    assert body["usage"]["completion_tokens"] == 3


def test_a_completion_body_is_a_completion(front):
    status, body = invoke(front, json.dumps({"prompt": "hello", "max_tokens": 2}).encode())
    assert status == 200 and body["object"] == "text_completion" and body["usage"]["completion_tokens"] == 2


def test_an_object_that_is_neither_gets_the_completion_endpoints_refusal(front):
    status, body = invoke(front, b'{"foo": 1}')
    assert status == 400 and "prompt" in body["error"]["message"]
    status, body = invoke(front, json.dumps({"messages": "not a list", "max_tokens": 2}).encode())
    assert status == 400 and "prompt" in body["error"]["message"]


def test_what_is_no_json_object_is_refused_in_vllms_words(front):
    status, body = invoke(front, b"[1, 2]")
    assert status == 400 and body["error"]["message"] == (
        "Cannot find suitable handler for request. Expected one of: ['ChatCompletionRequest', 'CompletionRequest']")
    status, body = invoke(front, b"not json")
    assert (status, body["error"]["type"]) == (400, "Bad Request")
    assert body["error"]["message"] == "JSON decode error: Expecting value: line 1 column 1 (char 0)"
    status, body = invoke(front, b"{}", "text/plain")
    assert status == 400 and body["error"]["message"] == "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed"
