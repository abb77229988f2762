"""Marked ``compare`` (needs ``.venv-vllm``, selected with ``-m compare``): the same
prompt-logprobs requests to `vllm serve` and `kvpool serve` of the tiny checkpoint
(float32): equal statuses; every ``prompt_logprobs`` entry (token ids in order, ranks,
decoded tokens; logprobs within 1e-3); under echo the prompt's part of ``logprobs``
alike; refusals naming the same field, kvpool's message vLLM's less the
``(parameter=..., value=...)`` suffix vLLM's errors add."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

LONG = "The scheduler owns every block of KV memory as a number, and the worker owns the memory itself. " * 4
REQUESTS = [
    {"prompt": "the cat sat on", "max_tokens": 0, "echo": True, "logprobs": 2},
    {"prompt": "the cat sat on the mat", "max_tokens": 1, "echo": True, "logprobs": 1, "prompt_logprobs": 4},
    {"prompt": LONG, "max_tokens": 1, "prompt_logprobs": 5},
    {"prompt": [[5, 6, 7, 8, 9, 10], [100, 200, 300, 2, 3], [42]], "max_tokens": 0, "echo": True, "logprobs": 1},
    {"prompt": "abc def", "max_tokens": 2, "prompt_logprobs": 0, "stream": True},
    {"prompt": "abc def", "max_tokens": 2, "prompt_logprobs": 1, "stream": True},
    {"prompt": "abc def", "max_tokens": 2, "prompt_logprobs": -2},
    {"prompt": "abc def", "max_tokens": 2, "prompt_logprobs": -1},
    {"prompt": "abc def", "max_tokens": 2, "prompt_logprobs": 21},
    {"prompt": "abc def", "max_tokens": 0},
]
CHAT = {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 2, "prompt_logprobs": 1}


def _post(url: str, path: str, body: dict) -> tuple[int, object]:
    req = urllib.request.Request(url + path, json.dumps({"model": "tiny", **body}).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            text = r.read().decode()
            return r.status, text if body.get("stream") else json.loads(text)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _same_entries(v: list | None, k: list | None) -> None:
    assert (v is None) == (k is None)
    for ev, ek in zip(v or [], k or [], strict=True):
        if ev is None:
            assert ek is None
            continue
        assert list(ev) == list(ek)
        for tid in ev:
            assert ek[tid]["rank"] == ev[tid]["rank"] and ek[tid]["decoded_token"] == ev[tid]["decoded_token"]
            assert ek[tid]["logprob"] == pytest.approx(ev[tid]["logprob"], abs=1e-3)


def _same_prompt_part(v: dict, k: dict, num_prompt: int) -> None:
    assert v["tokens"][:num_prompt] == k["tokens"][:num_prompt]
    assert v["text_offset"][:num_prompt] == k["text_offset"][:num_prompt]
    assert v["token_logprobs"][0] is None and k["token_logprobs"][0] is None
    assert k["token_logprobs"][1:num_prompt] == pytest.approx(v["token_logprobs"][1:num_prompt], abs=1e-3)
    for tv, tk in zip(v["top_logprobs"][1:num_prompt], k["top_logprobs"][1:num_prompt], strict=True):
        assert list(tv) == list(tk) and list(tk.values()) == pytest.approx(list(tv.values()), abs=1e-3)


def _compare(vs: tuple[int, object], ks: tuple[int, object], body: dict) -> None:
    assert vs[0] == ks[0], (body, vs, ks)
    if vs[0] != 200:
        ev, ek = vs[1]["error"], ks[1]["error"]
        assert ek["param"] == ev["param"] and ev["message"].startswith(ek["message"]), (ev, ek)
        return
    if body.get("stream"):
        return
    v, k = vs[1], ks[1]
    if "messages" in body:
        _same_entries(v["prompt_logprobs"], k["prompt_logprobs"])
        return
    for cv, ck in zip(v["choices"], k["choices"], strict=True):
        _same_entries(cv.get("prompt_logprobs"), ck.get("prompt_logprobs"))
        if body.get("echo") and body.get("logprobs") is not None:
            _same_prompt_part(cv["logprobs"], ck["logprobs"], len(cv["prompt_logprobs"]))
            if body["max_tokens"] == 0:
                assert cv["text"] == ck["text"] and cv["logprobs"]["tokens"] == ck["logprobs"]["tokens"]
    assert v["usage"]["prompt_tokens"] == k["usage"]["prompt_tokens"]
    assert v["usage"]["completion_tokens"] == k["usage"]["completion_tokens"]


@pytest.mark.compare
@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(1200)
def test_prompt_logprobs_as_vllm(real_vllm, tiny_checkpoint, tmp_path):
    from bench.compare.servers import Server, ServerConfig, free_port, server_command, vllm_env

    # NOTE: kvpool's budget of 64 tokens scores the long prompt over several chunks.
    cfg = ServerConfig(num_blocks=128, max_num_batched_tokens=64)
    answers = {}
    for engine in ("vllm", "kvpool"):
        port = free_port()
        env = {"OMP_NUM_THREADS": "1"} | (vllm_env(tmp_path / "cache", cfg, tiny_checkpoint, 1) if engine == "vllm" else {})
        with Server(engine, server_command(engine, tiny_checkpoint, port, cfg, real_vllm, "tiny"), env,
                    tmp_path / f"{engine}.log", port) as s:
            s.wait_ready(600)
            answers[engine] = [_post(s.url, "/v1/completions", b) for b in REQUESTS] + [_post(s.url, "/v1/chat/completions", CHAT)]
    for body, v, k in zip([*REQUESTS, CHAT], answers["vllm"], answers["kvpool"], strict=True):
        _compare(v, k, body)
