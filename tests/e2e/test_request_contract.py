"""Issue 23's logits fields, truncation, token ids in answers, request ids and the two
hangs, against a live ``kvpool serve`` of the tiny checkpoint over plain HTTP.

Every expected value is vLLM 0.32's answer to the same request on the same checkpoint
(``vllm serve ... --dtype float32 --seed 0 --enable-request-id-headers``, recorded
2026-12-02), or follows from hand reasoning where a comment says so. Every wait is
bounded by the HTTP timeout; the server is stopped when the module ends, also on
failure."""

from __future__ import annotations

import json
import math
import re
import threading
import urllib.error
import urllib.request

import pytest
from kvtest.serve import kvpool_serve

pytestmark = pytest.mark.e2e

HELLO = "hello world"
HELLO_IDS = [262, 380, 361, 80, 72]
GREEDY_8 = [256, 181, 467, 232, 53, 436, 203, 301]  # vLLM's greedy continuation of HELLO
CHAT = [{"role": "user", "content": "hi"}]
TIMEOUT_S = 60
WORDS = [f"w{i}" for i in range(70)]  # each tokenizes alone and after a space: 140 sequences


@pytest.fixture(scope="module")
def served(tiny_checkpoint, tmp_path_factory):
    with kvpool_serve(tiny_checkpoint, tmp_path_factory.mktemp("serve"), "--dtype", "float32", "--max-model-len", "2048",
                      "--enable-request-id-headers") as s:
        yield s


def call(served, path: str, body: dict, headers: dict | None = None):
    """(status, the JSON answer or the list of SSE events, the response headers)."""
    req = urllib.request.Request(served.base_url + path, json.dumps(body).encode(),
                                 {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:
            status, data, h = r.status, r.read().decode(), r.headers
    except urllib.error.HTTPError as e:
        status, data, h = e.code, e.read().decode(), e.headers
    if body.get("stream"):
        events = [line[6:] for line in data.split("\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]", data
        return status, [json.loads(e) for e in events[:-1]], h
    return status, json.loads(data), h


def completion(served, **fields):
    return call(served, "/v1/completions", {"prompt": HELLO, "temperature": 0, "return_token_ids": True, **fields})


def token_ids(answer) -> list[int]:
    return answer["choices"][0]["token_ids"]


@pytest.mark.parametrize(("fields", "expected", "finish"), [
    ({}, GREEDY_8, "length"),
    # every bias clamped to [-100, 100]: 300's +100 wins every step
    ({"logit_bias": {"100": 5.5, "7": -100, "300": 200}}, [300] * 8, "length"),
    # the bias before the repetition penalty (vLLM's order)
    ({"logit_bias": {"181": -2.5, "232": 3}, "repetition_penalty": 1.5}, [256, 408, 113, 420, 106, 132, 379, 427], "length"),
    ({"allowed_token_ids": [40, 41, 42, 43, 44, 45, 46, 47]}, [41] + [46] * 7, "length"),
    # "56" is token 467: banned, then EOS (1)
    ({"bad_words": ["56", "Q", " hello"]}, [256, 181, 1], "stop"),
    ({"bad_words": ["56", "Q", " hello"], "min_tokens": 5}, [256, 181, 96, 194, 432, 52, 509, 236], "length"),
    # "prefix" is 3 tokens, " prefix" one (436): a different length, so vLLM does not ban it
    ({"bad_words": ["prefix"]}, GREEDY_8, "length"),
])
def test_logits_fields_give_vllms_tokens(served, fields, expected, finish):
    status, answer, _ = completion(served, max_tokens=8, **fields)
    assert status == 200, answer
    assert token_ids(answer) == expected and answer["choices"][0]["finish_reason"] == finish


def test_logits_fields_in_chat_and_streams(served):
    body = {"messages": CHAT, "max_tokens": 4, "temperature": 0, "return_token_ids": True, "logit_bias": {"300": 100}}
    status, answer, _ = call(served, "/v1/chat/completions", body)
    assert status == 200 and token_ids(answer) == [300] * 4
    status, events, _ = completion(served, max_tokens=12, stream=True, allowed_token_ids=[40, 41, 42, 43, 44, 45, 46, 47])
    assert status == 200
    assert [t for e in events for c in e["choices"] for t in c["token_ids"]] == [41] + [46] * 10 + [40]


def test_a_biased_tokens_logprob_is_the_models_raw_one(served):
    status, answer, _ = completion(served, max_tokens=4, logprobs=1, logit_bias={"100": 100})
    assert status == 200 and token_ids(answer) == [100] * 4
    vllm = [-8.234885215759277, -5.250773906707764, -4.36199951171875, -5.263299942016602]
    assert all(math.isclose(a, b, abs_tol=1e-3) for a, b in zip(answer["choices"][0]["logprobs"]["token_logprobs"], vllm, strict=True))


REFUSALS = [
    ({"logit_bias": {"600": 1}}, "logit_bias",
     "token_id(s) [600] in logit_bias contain out-of-vocab token ids. Vocabulary size: 512 (parameter=logit_bias, value=[600])"),
    ({"allowed_token_ids": []}, "allowed_token_ids", "allowed_token_ids is not None and empty! (parameter=allowed_token_ids, value=[])"),
    ({"allowed_token_ids": [1, 600]}, "allowed_token_ids",
     "allowed_token_ids contains out-of-vocab token id! (parameter=allowed_token_ids, value=[600])"),
    ({"stop_token_ids": [-1]}, "stop_token_ids",
     "token_id(s) [-1] in stop_token_ids contain out-of-vocab token ids. Vocabulary size: 512 (parameter=stop_token_ids, value=[-1])"),
    # past int32 (once a hang): refused in the scheduler's words like any other
    ({"stop_token_ids": [2**31, 12]}, "stop_token_ids",
     f"token_id(s) [{2**31}] in stop_token_ids contain out-of-vocab token ids. Vocabulary size: 512 "
     f"(parameter=stop_token_ids, value=[{2**31}])"),
    ({"stop_token_ids": [2**40]}, "stop_token_ids",
     f"token_id(s) [{2**40}] in stop_token_ids contain out-of-vocab token ids. Vocabulary size: 512 "
     f"(parameter=stop_token_ids, value=[{2**40}])"),
    ({"truncate_prompt_tokens": 0}, None, "The decoder prompt cannot be empty"),
    # past int64, where no engine message reaches: still refused where vLLM's engine refuses
    ({"stop_token_ids": [2**70]}, "stop_token_ids",
     f"token_id(s) [{2**70}] in stop_token_ids contain out-of-vocab token ids. Vocabulary size: 512 "
     f"(parameter=stop_token_ids, value=[{2**70}])"),
    ({"bad_words": WORDS}, "bad_words",
     f"Too many bad words after tokenization: 129. The max number is 128. (parameter=bad_words, value={WORDS})"),
]


@pytest.mark.parametrize(("fields", "param", "message"), REFUSALS)
def test_out_of_vocabulary_ids_are_refused_as_vllm_refuses_them(served, fields, param, message):
    # not streamed: a 400 naming the field
    status, answer, _ = completion(served, max_tokens=4, **fields)
    assert status == 400 and answer["error"]["param"] == param and answer["error"]["message"] == message
    # streamed: vLLM's engine refuses once the stream started, an error event then [DONE]
    status, events, _ = completion(served, max_tokens=4, stream=True, **fields)
    assert status == 200 and events == [{"error": {"message": message, "type": "BadRequestError", "param": param, "code": 400}}]


@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"logit_bias": {"abc": 1, "x": 2}}, "logit_bias",
     "logit_bias contains key(s) that cannot be converted to integer token IDs: ['abc', 'x'] (parameter=logit_bias, value=['abc', 'x'])"),
    ({"bad_words": [""]}, None, "bad_words cannot contain an empty string. Got bad_words=['']"),
    ({"truncate_prompt_tokens": 2049}, "truncate_prompt_tokens",
     "truncate_prompt_tokens=2049 cannot be greater than max_model_len = 2048. Please request a smaller truncation size. "
     "(parameter=truncate_prompt_tokens, value=2049)"),
])
def test_request_shape_refusals_are_400_before_any_stream(served, fields, param, message):
    for stream in (False, True):
        req = urllib.request.Request(served.base_url + "/v1/completions", json.dumps({"prompt": HELLO, "max_tokens": 4, "stream": stream,
                                     **fields}).encode(), {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=TIMEOUT_S)
        assert info.value.code == 400
        assert json.loads(info.value.read())["error"] == {"message": message, "type": "BadRequestError", "param": param, "code": 400}


def test_a_request_id_longer_than_the_wire_carries_is_served(served):
    # Once a hang: the engine id outgrew the message. vLLM answers with the id whole.
    long_id = "r" * 300
    status, answer, _ = completion(served, max_tokens=2, request_id=long_id)
    assert status == 200 and answer["id"] == "cmpl-" + long_id and token_ids(answer) == GREEDY_8[:2]
    status, events, _ = call(served, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "stream": True},
                             {"X-Request-Id": long_id})
    assert status == 200 and {e["id"] for e in events} == {"chatcmpl-" + long_id}


def test_return_token_ids_where_vllm_puts_them(served):
    status, answer, _ = completion(served, prompt=[HELLO, "abc"], max_tokens=3)
    assert status == 200
    assert [(c["prompt_token_ids"], c["token_ids"]) for c in answer["choices"]] == [(HELLO_IDS, GREEDY_8[:3]), ([489, 71], [276, 403, 14])]
    # without it, both keys are there and null, as vLLM's
    status, answer, _ = call(served, "/v1/completions", {"prompt": HELLO, "max_tokens": 2})
    assert answer["choices"][0]["token_ids"] is None and answer["choices"][0]["prompt_token_ids"] is None
    # streamed: the prompt's ids in each choice's first chunk only, every chunk its new ids (an empty text too)
    status, events, _ = completion(served, max_tokens=3, stream=True)
    assert [(c["prompt_token_ids"], c["token_ids"], c["text"]) for e in events for c in e["choices"]] == [
        (HELLO_IDS, [256], ""), (None, [181], ""), (None, [467], "\ufffd\ufffd56")]
    # echo with return_token_ids echoes the ids, not the text
    status, answer, _ = completion(served, max_tokens=2, echo=True, prompt="abc")
    assert answer["choices"][0]["text"] == " to 5" and answer["choices"][0]["prompt_token_ids"] == [489, 71]


def test_chat_return_token_ids(served):
    body = {"messages": CHAT, "max_tokens": 3, "temperature": 0, "return_token_ids": True}
    status, answer, _ = call(served, "/v1/chat/completions", body)
    assert status == 200 and answer["prompt_token_ids"] == [0, 3, 76, 77, 1, 4] and token_ids(answer) == [272, 180, 437]
    status, events, _ = call(served, "/v1/chat/completions", {**body, "stream": True})
    assert events[0]["prompt_token_ids"] == [0, 3, 76, 77, 1, 4] and events[0]["prompt_text"] is None
    assert [c["token_ids"] for e in events[1:] for c in e["choices"]] == [[272], [180], [437]]
    status, events, _ = call(served, "/v1/chat/completions", {**body, "stream": True, "return_token_ids": False})
    assert events[0]["prompt_token_ids"] is None and all(c["token_ids"] is None for e in events[1:] for c in e["choices"])


@pytest.mark.parametrize(("path", "fields", "prompt_ids", "output_ids"), [
    ("/v1/completions", {"prompt": "hello world, how are you", "truncate_prompt_tokens": 3}, [91, 334, 409], [165, 133]),
    ("/v1/completions", {"prompt": "hello world, how are you", "truncate_prompt_tokens": 3, "truncation_side": "right"},
     [262, 380, 361], [2, 504]),
    ("/v1/completions", {"prompt": "hello world, how are you", "truncate_prompt_tokens": -1},
     [262, 380, 361, 80, 72, 16, 225, 375, 91, 334, 409], [106, 53]),
    ("/v1/completions", {"prompt": [5, 6, 7, 8, 9], "truncate_prompt_tokens": 3}, [7, 8, 9], [36, 109]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi there"}], "truncate_prompt_tokens": 3}, [263, 1, 4], [214, 54]),
])
def test_truncate_prompt_tokens_keeps_what_vllm_keeps(served, path, fields, prompt_ids, output_ids):
    status, answer, _ = call(served, path, {"max_tokens": 2, "temperature": 0, "return_token_ids": True, **fields})
    assert status == 200, answer
    got = answer["prompt_token_ids"] if "messages" in fields else answer["choices"][0]["prompt_token_ids"]
    assert (got, token_ids(answer), answer["usage"]["prompt_tokens"]) == (prompt_ids, output_ids, len(prompt_ids))


def test_request_ids_as_vllm_answers_them(served):
    _, answer, h = call(served, "/v1/completions", {"prompt": HELLO, "max_tokens": 2, "request_id": "body-1"}, {"X-Request-Id": "hdr-1"})
    assert (answer["id"], h["X-Request-Id"]) == ("cmpl-hdr-1", "hdr-1")
    _, answer, h = call(served, "/v1/completions", {"prompt": HELLO, "max_tokens": 2, "request_id": "body-1"})
    assert answer["id"] == "cmpl-body-1" and re.fullmatch(r"[0-9a-f]{32}", h["X-Request-Id"])
    _, answer, _ = call(served, "/v1/completions", {"prompt": HELLO, "max_tokens": 2})
    assert re.fullmatch(r"cmpl-[0-9a-f]{16}", answer["id"])  # vLLM's random_uuid
    # one id, two requests at once: each runs whole (the engine ids differ)
    results = [None, None]

    def run(i):
        results[i] = call(served, "/v1/completions", {"prompt": HELLO, "max_tokens": 40, "ignore_eos": True, "temperature": 0},
                          {"X-Request-Id": "same"})

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S + 5)
    assert all(r is not None and r[0] == 200 for r in results)
    assert [(r[1]["id"], r[1]["usage"]["completion_tokens"]) for r in results] == [("cmpl-same", 40)] * 2
    assert results[0][1]["choices"][0]["text"] == results[1][1]["choices"][0]["text"]


def test_render_shows_the_logits_fields_as_vllms_sampling_params(served):
    body = {"prompt": "hi", "max_tokens": 2, "logit_bias": {"5": 1.5, "7": 300}, "allowed_token_ids": [3, 4, 3], "bad_words": ["ab"],
            "stop_token_ids": [9, 9], "truncate_prompt_tokens": 1}
    status, answer, _ = call(served, "/v1/completions/render", body)
    assert status == 200
    sp = answer[0]["sampling_params"]
    # vLLM 0.32's /v1/completions/render (with --enable-scale-out) answered these values
    assert answer[0]["token_ids"] == [77]
    assert (sp["logit_bias"], sp["allowed_token_ids"], sp["bad_words"], sp["stop_token_ids"]) == (
        {"5": 1.5, "7": 100.0}, [3, 4, 3], ["ab"], [9])
