"""vLLM 0.32's Frontend flags read by its serving classes and middleware, against a real
``python -m frontend`` and the fake scheduler: each with the flag, and its default
without. Expected values are vLLM's, as read in its source and seen from `vllm serve`
0.32 on the tiny checkpoint (X-Request-Id, /tokenizer_info, the output log lines)."""

from __future__ import annotations

import http.client
import json
import re
import time
import urllib.error
import urllib.request

import pytest
from kvtest.fake_engine import fake_engine, frontend_process

from frontend.sampling.params import default_sampling, max_tokens_cap, output_budget

TEMPLATE = "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
ON = ("--enable-request-id-headers", "--enable-force-include-usage",
      "--override-generation-config", '{"temperature": 0.5, "top_k": 50, "presence_penalty": 0.25, "top_p": null, "max_new_tokens": 5}',
      "--chat-template", TEMPLATE, "--default-chat-template-kwargs", '{"greeting": "HELLO", "other": 1}',
      "--disable-access-log-for-endpoints", "/v1/models, /version,", "--enable-log-requests", "--enable-log-outputs",
      "--max-log-len", "2", "--enable-tokenizer-info-endpoint", "--log-error-stack", "--sse-keep-alive-interval", "1")


@pytest.fixture(scope="module")
def on(tiny_checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("serving-flags") / "frontend.log"
    with fake_engine() as engine, frontend_process(tiny_checkpoint, engine, log, *ON) as f:
        f.engine = engine
        yield f


@pytest.fixture(scope="module")
def off(tiny_checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("serving-flags-off") / "frontend.log"
    with fake_engine() as engine, frontend_process(tiny_checkpoint, engine, log, "--enable-log-requests") as f:
        f.engine = engine
        yield f


def call(front, path: str, body: dict | None = None, headers: dict | None = None) -> tuple[int, dict, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(front.base_url + path, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def events(raw: bytes) -> list[dict]:
    return [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: {")]


def wait_for_log(front, text: str, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while text not in (out := front.output()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{text!r} not logged:\n{out[-3000:]}")
        time.sleep(0.05)
    return out


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


# --- --enable-request-id-headers ----------------------------------------------------


def test_every_response_carries_x_request_id_the_clients_or_a_fresh_one(on):
    status, headers, _ = call(on, "/v1/models", headers={"X-Request-Id": "mine-1"})
    assert status == 200 and headers["X-Request-Id"] == "mine-1"
    ids = {call(on, "/v1/models")[1]["X-Request-Id"] for _ in range(2)}
    assert len(ids) == 2 and all(len(i) == 32 and int(i, 16) >= 0 for i in ids)  # uuid4().hex, one per response
    status, headers, _ = call(on, "/no/such/route", headers={"X-Request-Id": "mine-2"})
    assert status == 404 and headers["X-Request-Id"] == "mine-2"  # vLLM's middleware is the outermost
    status, headers, raw = call(on, "/v1/chat/completions", {**CHAT, "stream": True}, {"X-Request-Id": "mine-3"})
    assert status == 200 and headers["X-Request-Id"] == "mine-3" and raw.endswith(b"data: [DONE]\n\n")


def test_without_the_flag_no_x_request_id(off):
    status, headers, _ = call(off, "/v1/models", headers={"X-Request-Id": "mine"})
    assert status == 200 and "X-Request-Id" not in headers


def test_a_response_id_is_vllms_prefix_and_the_x_request_id_else_the_bodys_request_id(off):
    # NOTE: with or without the flag, as vLLM's _base_request_id
    body = {"prompt": "hello", "max_tokens": 2, "request_id": "from-body"}
    assert json.loads(call(off, "/v1/completions", body)[2])["id"] == "cmpl-from-body"
    assert json.loads(call(off, "/v1/completions", body, {"X-Request-Id": "from-header"})[2])["id"] == "cmpl-from-header"
    chat = json.loads(call(off, "/v1/chat/completions", CHAT, {"X-Request-Id": "h"})[2])["id"]
    # the engine request: the response id, the choice, a random suffix of its own (as vLLM's internal ids)
    assert chat == "chatcmpl-h" and re.fullmatch(r"chatcmpl-h-0-[0-9a-f]{8}", off.engine.generated[-1].request_id)
    random = json.loads(call(off, "/v1/chat/completions", CHAT)[2])["id"]
    # vLLM's random_uuid: 16 hex digits (a live vllm serve answered "cmpl-bd3d4507657f61d1")
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{16}", random)


# --- --enable-force-include-usage ---------------------------------------------------


@pytest.mark.parametrize(("path", "body"), [("/v1/completions", {"prompt": "hello", "max_tokens": 3}), ("/v1/chat/completions", CHAT)],
                         ids=["completion", "chat"])
def test_a_stream_gives_usage_in_every_chunk_and_at_its_end_unasked(on, off, path, body):
    chunks = events(call(on, path, {**body, "stream": True})[2])
    final = chunks[-1]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 3
    assert all("usage" in c for c in chunks)  # continuous_usage_stats, as vLLM's should_include_usage
    # even a request that asked for none (vLLM's flag wins over stream_options)
    asked_none = events(call(on, path, {**body, "stream": True, "stream_options": {"include_usage": False}})[2])
    assert asked_none[-1]["choices"] == [] and asked_none[-1]["usage"]["total_tokens"] == final["usage"]["total_tokens"]
    assert all("usage" not in c for c in events(call(off, path, {**body, "stream": True})[2]))


# --- --override-generation-config ---------------------------------------------------


def test_the_override_sets_the_defaults_a_request_leaves_out(on, off):
    assert call(on, "/v1/completions", {"prompt": "hello", "max_tokens": 2})[0] == 200
    g = on.engine.generated[-1]
    # NOTE: a null in the override is no default (vLLM keeps only non-null values).
    assert (g.temperature, g.top_k, g.presence_penalty, g.top_p, g.frequency_penalty) == (0.5, 50, 0.25, 1.0, 0.0)
    assert call(on, "/v1/completions", {"prompt": "hello", "max_tokens": 2, "temperature": 0.9, "presence_penalty": 0})[0] == 200
    g = on.engine.generated[-1]
    assert (g.temperature, g.presence_penalty, g.top_k) == (0.9, 0.0, 50)  # the request's own win
    assert call(off, "/v1/completions", {"prompt": "hello", "max_tokens": 2})[0] == 200
    g = off.engine.generated[-1]
    assert (g.temperature, g.top_k, g.presence_penalty) == (1.0, 0, 0.0)  # vLLM's own defaults


def test_the_overrides_max_new_tokens_bounds_every_requests_max_tokens(on, off, hf_tokenizer):
    assert call(on, "/v1/completions", {"prompt": "hello", "max_tokens": 16})[0] == 200
    assert on.engine.generated[-1].max_tokens == 5  # vLLM's override_max_tokens: a bound, not only a default
    assert call(on, "/v1/chat/completions", {"messages": CHAT["messages"]})[0] == 200
    assert on.engine.generated[-1].max_tokens == 5
    assert call(off, "/v1/chat/completions", {"messages": CHAT["messages"]})[0] == 200
    g = off.engine.generated[-1]
    assert g.max_tokens == 4096 - len(g.prompt_token_ids)  # the context's rest (python -m frontend's --max-model-len 4096)


def test_vllms_merge_of_generation_config_and_override(tmp_path, tiny_checkpoint):
    # --generation-config vllm: the override's keys alone (the checkpoint's file unread)
    assert default_sampling("vllm", tiny_checkpoint, {"temperature": 0.5, "seed": 3}) == {"temperature": 0.5}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 9, "do_sample": True}))
    folder = str(tmp_path)
    assert default_sampling(folder, tiny_checkpoint) == {"temperature": 0.7, "top_p": 0.9, "max_tokens": 9}
    merged = default_sampling(folder, tiny_checkpoint, {"top_p": None, "max_new_tokens": 4, "frequency_penalty": 0.5})
    assert merged == {"frequency_penalty": 0.5, "temperature": 0.7, "max_tokens": 4}  # a null drops the file's value
    assert max_tokens_cap(folder, {"max_tokens": 9}, None) == 9  # a folder's max_new_tokens bounds every request
    assert max_tokens_cap("auto", {"max_tokens": 9}, None) is None  # the model's own is a default only
    assert max_tokens_cap("auto", {"max_tokens": 4}, {"max_new_tokens": 4}) == 4
    assert output_budget(None, 10, 100, {}, None) == 90 and output_budget(None, 10, 100, {"max_tokens": 7}, None) == 7
    assert output_budget(50, 10, 100, {"max_tokens": 7}, None) == 50 and output_budget(50, 10, 100, {}, 20) == 20


# --- --default-chat-template-kwargs -------------------------------------------------


@pytest.mark.parametrize(("kwargs", "greeting"), [(None, "HELLO"), ({"greeting": "BYE"}, "BYE"), ({"greeting": None}, "HELLO"),
                                                  ({"greeting": "auto"}, "HELLO")], ids=["default", "request", "null", "auto"])
def test_the_defaults_go_under_a_requests_chat_template_kwargs(on, hf_tokenizer, kwargs, greeting):
    body = {**CHAT, "chat_template_kwargs": kwargs} if kwargs is not None else CHAT
    assert call(on, "/v1/chat/completions", body)[0] == 200
    assert on.engine.generated[-1].prompt_token_ids == hf_tokenizer.encode(greeting + "hi", add_special_tokens=False)


def test_tokenize_renders_messages_with_the_defaults_too(on, hf_tokenizer):
    # NOTE: as vLLM's /tokenize (its default_template_kwargs), a request's own on top
    for kwargs, greeting in ((None, "HELLO"), ({"greeting": "BYE"}, "BYE")):
        body = {"messages": CHAT["messages"], **({"chat_template_kwargs": kwargs} if kwargs else {})}
        status, _, raw = call(on, "/tokenize", body)
        assert status == 200 and json.loads(raw)["tokens"] == hf_tokenizer.encode(greeting + "hi", add_special_tokens=False)


# --- --disable-access-log-for-endpoints ---------------------------------------------


def test_the_access_log_leaves_out_the_paths_given(on):
    for path in ("/v1/models?x=1", "/version", "/health"):
        assert call(on, path)[0] == 200
    out = wait_for_log(on, '"GET /health HTTP/1.1" 200 OK')
    assert '"GET /v1/models' not in out and '"GET /version' not in out


# --- --enable-log-outputs (with --max-log-len 2) ------------------------------------


def test_a_chat_output_is_logged_cut_to_max_log_len(on):
    status, _, raw = call(on, "/v1/chat/completions", {**CHAT, "request_id": "chat-whole"})
    text = json.loads(raw)["choices"][0]["message"]["content"]
    assert len(text) > 2  # NOTE: so that the cut shows
    wait_for_log(on, f"Generated response chatcmpl-chat-whole: output: {text[:2]!r}, finish_reason: length")


def test_a_streamed_chat_logs_its_deltas_then_its_whole_text(on):
    raw = call(on, "/v1/chat/completions", {**CHAT, "stream": True, "request_id": "chat-stream"})[2]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in events(raw) if c["choices"])
    assert len(text) > 2
    out = wait_for_log(on, f"Generated response chatcmpl-chat-stream (streaming complete): output: {text[:2]!r}, finish_reason: streaming_complete")
    # NOTE: the fake scheduler sends every token in one output: one delta, the whole text
    assert f"Generated response chatcmpl-chat-stream (streaming delta): output: {text[:2]!r}, finish_reason: length" in out


def test_a_completion_logs_no_output_as_vllm(on, off):
    call(on, "/v1/completions", {"prompt": "hello", "max_tokens": 2, "request_id": "quiet"})
    wait_for_log(on, "Received request cmpl-quiet")
    call(on, "/v1/models")  # NOTE: a later request: the completion's handler has returned
    assert "Generated response cmpl-quiet" not in on.output()
    call(off, "/v1/chat/completions", {**CHAT, "request_id": "chat-off"})
    wait_for_log(off, "Received request chatcmpl-chat-off")
    assert "Generated response" not in off.output()


# --- --enable-tokenizer-info-endpoint -----------------------------------------------


def test_tokenizer_info_as_vllm_answers_it(on, off, tiny_checkpoint):
    status, _, raw = call(on, "/tokenizer_info")
    # `vllm serve` 0.32's answer for the tiny checkpoint (transformers 5), --chat-template's template in it
    expected = {"tokenizer_class": "TokenizerPoolCachedTokenizersBackend", "bos_token": "<|bos|>", "chat_template": TEMPLATE,
                "eos_token": "<|eos|>", "model_max_length": 131072, "truncation_side": "left", "name_or_path": str(tiny_checkpoint),
                "is_local": True, "local_files_only": True,
                "added_tokens_decoder": {"0": "<|bos|>", "1": "<|eos|>", "2": "<|system|>", "3": "<|user|>", "4": "<|assistant|>"},
                "backend": "tokenizers"}
    assert status == 200 and list(json.loads(raw).items()) == list(expected.items())
    assert call(off, "/tokenizer_info")[0] == 404


# --- --log-error-stack --------------------------------------------------------------


def test_an_error_response_logs_what_vllms_handlers_log(on, off):
    assert call(on, "/v1/completions", {"prompt": "hello", "max_tokens": "many"})[0] == 400
    out = wait_for_log(on, "RequestValidationError caught. Request id: None")
    assert "Traceback (most recent call last)" in out.split("RequestValidationError caught.")[1]
    assert call(on, "/v1/chat/completions", {"messages": []})[0] == 400
    wait_for_log(on, "Exception caught. Request id: None")  # refused before vLLM's request has an id
    assert call(on, "/v1/completions", {"prompt": "hello", "n": 0, "request_id": "bad-n"})[0] == 400
    wait_for_log(on, "Exception caught. Request id: cmpl-bad-n")  # its sampling fields: after
    caught = on.output().count("caught. Request id")
    assert call(on, "/v1/completions", {"prompt": "hello", "model": "nope"})[0] == 404
    wait_for_log(on, '"POST /v1/completions" 404')
    assert on.output().count("caught. Request id") == caught  # as vLLM: an unknown model logs nothing
    assert call(off, "/v1/completions", {"prompt": "hello", "max_tokens": "many"})[0] == 400
    wait_for_log(off, '"POST /v1/completions" 400')
    assert "caught. Request id" not in off.output()


# --- --sse-keep-alive-interval 1 ----------------------------------------------------


def test_a_waiting_stream_gets_keep_alive_comments(on):
    on.engine.holding.set()
    conn = http.client.HTTPConnection("127.0.0.1", on.port, timeout=30)
    try:
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "hello", "max_tokens": 2, "stream": True}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.readline() == b": keep-alive\n" and resp.readline() == b"\n"  # within ~1 s of silence
        assert resp.readline() == b": keep-alive\n" and resp.readline() == b"\n"  # and again
        on.engine.release()
        rest = resp.read()
        assert rest.startswith(b"data: {") and rest.endswith(b"data: [DONE]\n\n")
    finally:
        on.engine.release()
        conn.close()
