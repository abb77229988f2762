"""Issue 23's bar for structured outputs: greedy output under the same grammar equals
vLLM's token for token. Marked ``compare`` (needs ``.venv-vllm``, selected with
``-m compare``): a live ``vllm serve`` and a live ``kvpool serve`` of the tiny
checkpoint, float32, temperature 0, the same requests (every kind of constraint, both
endpoints); the token ids (``return_tokens_as_token_ids`` logprobs), finish reasons and
logprobs must agree, and specs xgrammar refuses must be a 400 on both."""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from bench.compare.servers import Server, ServerConfig, free_port, server_command, vllm_env

ROOT = Path(__file__).resolve().parents[3]
CFG = ServerConfig(block_size=32, num_blocks=128, max_num_seqs=8, max_model_len=2048, kv_cache_metrics=False)
NAME = "tiny"
SCHEMA = {"type": "object", "properties": {"c": {"enum": ["x", "y"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9},
          "s": {"type": "string", "maxLength": 6}}, "required": ["c", "n", "s"], "additionalProperties": False}
GREEDY = [
    {"prompt": "hello", "max_tokens": 20, "structured_outputs": {"choice": ["yes", "no", "maybe"]}},
    {"prompt": "hello", "max_tokens": 30, "structured_outputs": {"regex": "[a-z]+@[a-z]+\\.com"}},
    {"prompt": "the cat", "max_tokens": 40, "structured_outputs": {"regex": "[a-z]{2,6}-[0-9]{2}"}},
    {"prompt": "the cat", "max_tokens": 80, "structured_outputs": {"json": SCHEMA}},
    {"prompt": "hello", "max_tokens": 120, "structured_outputs": {"json": json.dumps(SCHEMA)}},
    {"prompt": "the cat", "max_tokens": 40, "response_format": {"type": "json_object"}},
    {"prompt": "a b c", "max_tokens": 60, "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}},
    {"prompt": "a b c", "max_tokens": 30, "structured_outputs": {"grammar": 'root ::= ("ab" | "cd")+ "."'}},
    {"prompt": "a b c", "max_tokens": 30, "structured_outputs": {"grammar": 'start: "x" ("y" | "z")*'}},
    # ignore_eos: the grammar completes, then its matcher is terminated and masks nothing
    {"prompt": "hello", "max_tokens": 12, "ignore_eos": True, "structured_outputs": {"choice": ["yes", "no"]}},
]
CHAT = [
    {"max_tokens": 60, "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}},
    {"max_tokens": 20, "structured_outputs": {"choice": ["yes", "no", "maybe"]}},
]
REFUSED = [
    {"structured_outputs": {"choice": []}},
    {"structured_outputs": {"json": "{bad"}},
    {"structured_outputs": {"json_object": False}},
    {"structured_outputs": {"regex": "a", "choice": ["b"]}},
    {"response_format": {"type": "json_schema"}},
]


def post(url: str, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def greedy_answer(url: str, body: dict) -> tuple:
    status, r = post(url, "/v1/completions", {"model": NAME, "temperature": 0, "logprobs": 1, "return_tokens_as_token_ids": True, **body})
    assert status == 200, r
    c = r["choices"][0]
    return c["logprobs"]["tokens"], c["finish_reason"], c["text"], c["logprobs"]["token_logprobs"]


def chat_answer(url: str, body: dict) -> tuple:
    messages = [{"role": "user", "content": "hello"}]
    status, r = post(url, "/v1/chat/completions", {"model": NAME, "messages": messages, "temperature": 0, "logprobs": True,
                                                   "return_tokens_as_token_ids": True, **body})
    assert status == 200, r
    c = r["choices"][0]
    return [t["token"] for t in c["logprobs"]["content"]], c["finish_reason"], c["message"]["content"]


def answers(url: str) -> dict:
    return {
        "greedy": [greedy_answer(url, b) for b in GREEDY],
        "chat": [chat_answer(url, b) for b in CHAT],
        "refused": [post(url, "/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": 5, **b})[0] for b in REFUSED],
    }


@pytest.mark.compare
@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_greedy_structured_outputs_equal_vllms_token_for_token(real_vllm, tmp_path):
    from bench.compare.checkpoints import checkpoint_dir

    model = checkpoint_dir("tiny")
    got = {}
    for engine in ("vllm", "kvpool"):
        port = free_port()
        env = vllm_env(tmp_path / "cache", CFG, model, 1) | {"OMP_NUM_THREADS": "1"} if engine == "vllm" else {}
        with Server(engine, server_command(engine, model, port, CFG, ROOT, NAME), env, tmp_path / f"{engine}.log", port) as s:
            s.wait_ready(600)
            got[engine] = answers(s.url)
    v, k = got["vllm"], got["kvpool"]
    assert all(code == 400 for code in v["refused"]) and k["refused"] == v["refused"]
    assert [a[:3] for a in k["chat"]] == [a[:3] for a in v["chat"]]
    for (vt, vf, vtext, vlp), (kt, kf, ktext, klp) in zip(v["greedy"], k["greedy"], strict=True):
        assert (kt, kf, ktext) == (vt, vf, vtext)
        assert all(math.isclose(a, b, abs_tol=1e-3) for a, b in zip(vlp, klp, strict=True))
    assert any(f == "stop" for _, f, _, _ in v["greedy"])  # some grammars completed and allowed EOS
