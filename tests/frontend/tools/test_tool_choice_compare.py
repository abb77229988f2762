"""tools and tool_choice, the same requests to a live `vllm serve` and a live `kvpool
serve`, both with --enable-auto-tool-choice --tool-call-parser hermes (marked
``compare``: needs .venv-vllm, selected with ``-m compare``): the same status codes and
error bodies, and, where the model writes freely ("none", "auto"), the same greedy
answer whole and streamed.

"required" and a named function are forced by the parser's structural tag on both
sides (kvpool compiles it in its structured outputs): the same greedy text and calls
(names and arguments; the call ids are random on both), whole and streamed, for a
free-form tool and a strict one."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
FLAGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "w",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
SAME_ANSWER = {"none": {"tool_choice": "none"}, "auto": {"tool_choice": "auto"}, "default": {}, "null": {"tool_choice": None},
               "parallel_false": {"tool_choice": "auto", "parallel_tool_calls": False}}
REFUSED = {
    "named_missing": {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
    "named_no_function": {"tools": TOOLS, "tool_choice": {"type": "function"}},
    "bad_choice": {"tools": TOOLS, "tool_choice": "sometimes"},
    "choice_without_tools": {"tool_choice": "auto"},
    "empty_tools": {"tools": []},
    "bad_tool_type": {"tools": [{"type": "x", "function": {"name": "f"}}]},
    "tool_without_function": {"tools": [{"type": "function"}]},
    "named_with_structured_outputs": {"tools": TOOLS, "tool_choice": NAMED, "structured_outputs": {"regex": "a+"}},
    "named_bad_type": {"tools": TOOLS, "tool_choice": {"type": "other", "function": {"name": "get_weather"}}},
    "bad_tool_and_bad_choice": {"tools": [{"type": "x", "function": {"name": "f"}}], "tool_choice": "sometimes"},
    "parameters_not_an_object": {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
}


def post(url: str, body: dict, stream: bool = False):
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            raw = r.read().decode()
            status = r.status
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    if not stream:
        return status, json.loads(raw)
    chunks = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]
    return status, chunks


@pytest.fixture(scope="module")
def servers(real_vllm, tmp_path_factory):
    from bench.compare.checkpoints import checkpoint_dir
    from bench.compare.servers import Server, ServerConfig, free_port, server_command, vllm_env

    tmp = tmp_path_factory.mktemp("tools-compare")
    model, cfg = checkpoint_dir("tiny"), ServerConfig(num_blocks=64, max_model_len=63 * 32)  # NOTE: vLLM keeps one block back
    vp, kp = free_port(), free_port()
    vllm = Server("vllm", [*server_command("vllm", model, vp, cfg, ROOT, "m"), *FLAGS], vllm_env(tmp / "cache", cfg, model, 1), tmp / "vllm.log", vp)
    kvpool = Server("kvpool", [*server_command("kvpool", model, kp, cfg, ROOT, "m"), *FLAGS], {}, tmp / "kvpool.log", kp)
    with vllm, kvpool:
        vllm.wait_ready(600)
        kvpool.wait_ready(300)
        yield vllm.url, kvpool.url


def chat(**fields) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0, **fields}


def answer(body: dict) -> list[tuple]:
    """Each choice's text, calls (less their random ids) and finish reason."""
    def calls(c):
        return [(t["type"], t["function"]["name"], t["function"]["arguments"]) for t in c["message"].get("tool_calls") or []]

    return [(c["message"].get("content"), calls(c), c["finish_reason"]) for c in body["choices"]]


STRICT = [{"type": "function", "function": {"name": "set_flag", "strict": True, "parameters": {
    "type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"], "additionalProperties": False}}}]


@pytest.mark.compare
@pytest.mark.timeout(1200)
def test_same_answers_and_refusals_as_vllm(servers):
    vllm, kvpool = servers
    for name, fields in SAME_ANSWER.items():
        (vs, vb), (ks, kb) = post(vllm, chat(tools=TOOLS, **fields)), post(kvpool, chat(tools=TOOLS, **fields))
        assert vs == ks == 200 and answer(kb) == answer(vb), name
        (vs, vc), (ks, kc) = (post(url, chat(tools=TOOLS, stream=True, **fields), stream=True) for url in (vllm, kvpool))
        text = ["".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) for chunks in (vc, kc)]
        finish = [[c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]] for chunks in (vc, kc)]
        assert text[0] == text[1] and finish[0] == finish[1], name
    for name, fields in REFUSED.items():
        (vs, vb), (ks, kb) = post(vllm, chat(**fields)), post(kvpool, chat(**fields))
        assert vs == ks == 400 and kb["error"] == vb["error"], name
    for tools, choice, max_tokens in ((TOOLS, "required", 8), (TOOLS, NAMED, 8), (STRICT, "required", 60),
                                      (STRICT, {"type": "function", "function": {"name": "set_flag"}}, 60)):
        body = {**chat(tools=tools, tool_choice=choice), "max_tokens": max_tokens}
        (vs, vb), (ks, kb) = post(vllm, body), post(kvpool, body)
        assert vs == ks == 200 and answer(kb) == answer(vb), (choice, answer(vb), answer(kb))
