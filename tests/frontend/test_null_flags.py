"""vLLM declares some switches nullable (``stream``, a completion's ``echo``, a chat's
``logprobs``, /tokenize's ``return_token_strs``: ``bool | None = False``) and reads
``null`` as off; so does kvpool: a live server answers such a request as it answers one
without the field, where it used to refuse it with a 400 (found by the schema fuzzer)."""

from __future__ import annotations

import json
import urllib.request

import pytest


def _post(base_url: str, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(base_url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.status, json.loads(r.read())


@pytest.mark.parametrize("path, body, null", [
    ("/v1/completions", {"prompt": "hello there", "max_tokens": 4, "temperature": 0}, ("stream", "echo")),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0},
     ("stream", "logprobs")),
    ("/tokenize", {"prompt": "hello there"}, ("return_token_strs",)),
])
def test_null_switches_are_read_as_off(served, model, path, body, null):
    body = {"model": model, **body}
    status, plain = _post(served.base_url, path, body)
    status_null, nulled = _post(served.base_url, path, {**body, **dict.fromkeys(null)})
    assert status == status_null == 200
    for answer in (plain, nulled):
        for key in ("id", "created", "system_fingerprint"):
            answer.pop(key, None)
    assert nulled == plain
