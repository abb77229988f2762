"""vLLM 0.32's API-server flags on a real `python -m frontend` (fake scheduler), as
`vllm serve` answers with them: --max-logprobs (vLLM's 400 above it), --response-role
(a continued message keeps its own role), --chat-template (a file or the template
itself), --root-path (every route with the prefix and without), uvicorn's access log
(--disable-uvicorn-access-log, --uvicorn-log-level) and --disable-fastapi-docs."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request

import pytest
from kvtest.fake_engine import fake_engine, frontend_process

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
ACCESS_LINE = re.compile(r'frontend\.access: 127\.0\.0\.1:\d+ - "GET /version HTTP/1\.1" 200 OK')


def call(front, path: str, body: dict | None = None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(front.base_url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def front(tiny_checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("flags") / "frontend.log"
    flags = ("--max-logprobs", "5", "--response-role", "bot", "--chat-template", TEMPLATE, "--root-path", "/pfx")
    with fake_engine() as engine, frontend_process(tiny_checkpoint, engine, log, *flags) as f:
        yield f


def test_max_logprobs_refuses_more_in_vllms_words(front, tiny_checkpoint):
    model = str(tiny_checkpoint)
    status, body = call(front, "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 1, "logprobs": 6})
    assert (status, body["error"]["param"]) == (400, "logprobs")
    assert body["error"]["message"] == "Requested sample logprobs of 6, which is greater than max allowed: 5"
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "logprobs": True}
    assert call(front, "/v1/chat/completions", {**chat, "top_logprobs": 6})[0] == 400
    assert call(front, "/v1/chat/completions", {**chat, "top_logprobs": 5})[0] == 200
    assert call(front, "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 1, "logprobs": 5})[0] == 200


def test_response_role_and_a_continued_message(front, tiny_checkpoint):
    chat = {"model": str(tiny_checkpoint), "max_tokens": 2}
    status, body = call(front, "/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and body["choices"][0]["message"]["role"] == "bot"
    messages = [{"role": "user", "content": "hi"}, {"role": "narrator", "content": "Once"}]
    status, body = call(front, "/v1/chat/completions", {**chat, "messages": messages, "add_generation_prompt": False})
    assert status == 200 and body["choices"][0]["message"]["role"] == "narrator"


def _chat_tokens_equal_the_text(front, text: str) -> bool:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    status, chat = call(front, "/tokenize", {"messages": messages, "add_special_tokens": False})
    assert status == 200
    status, plain = call(front, "/tokenize", {"prompt": text, "add_special_tokens": False})
    return chat["tokens"] == plain["tokens"]


def test_an_inline_chat_template_is_the_template(front):
    assert _chat_tokens_equal_the_text(front, "<user>hi<assistant>yo")


def test_root_path_serves_every_route_with_and_without_the_prefix(front):
    for path in ("/version", "/pfx/version"):
        status, body = call(front, path)
        assert status == 200 and body["version"] == "0.32.0"
    assert call(front, "/pfx/v1/models")[0] == 200 and call(front, "/pfxv1/models")[0] == 404


def test_the_access_log_is_uvicorns_line(front):
    call(front, "/version")
    deadline = time.monotonic() + 10
    while not ACCESS_LINE.search(front.output()):
        assert time.monotonic() < deadline, front.output()[-2000:]
        time.sleep(0.1)


@pytest.mark.parametrize("flags", [("--disable-uvicorn-access-log",), ("--uvicorn-log-level", "warning")], ids=["disabled", "warning"])
def test_no_access_log(tiny_checkpoint, tmp_path, flags):
    (tmp_path / "t.jinja").write_text(TEMPLATE.replace("<", "(").replace(">", ")"))
    flags = (*flags, "--chat-template", str(tmp_path / "t.jinja"), "--disable-fastapi-docs")
    with fake_engine() as engine, frontend_process(tiny_checkpoint, engine, tmp_path / "f.log", *flags) as f:
        assert call(f, "/version")[0] == 200
        assert _chat_tokens_equal_the_text(f, "(user)hi(assistant)yo")  # the file's template
        assert call(f, "/docs")[0] == 404  # --disable-fastapi-docs: no docs routes (frontend/routes/openapi.py)
        time.sleep(0.5)
        assert "frontend.access" not in f.output() and "serving " in f.output()
