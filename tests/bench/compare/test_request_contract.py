"""Issue 23's logits fields, truncation, return_token_ids and request ids: the same
requests to ``vllm serve`` and ``kvpool serve`` on the tiny checkpoint, and equal
answers -- status, error objects, token ids (prompt and output), finish reasons,
logprobs within 1e-3, response ids. Marked ``compare``: it runs vLLM itself
(``-m compare``); both servers are stopped when it ends, also on failure."""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request

import pytest
from kvtest.ports import free_port
from kvtest.serve import kvpool_serve

from bench.compare.servers import Server

M_LEN = 2048
REQUESTS = [
    ("/v1/completions", {"prompt": "hello world", "max_tokens": 8}),
    ("/v1/completions", {"prompt": "hello world", "max_tokens": 8, "logit_bias": {"100": 5.5, "7": -100, "300": 200}}),
    ("/v1/completions", {"prompt": "hello world", "max_tokens": 8, "logit_bias": {"181": -2.5, "232": 3}, "repetition_penalty": 1.5}),
    ("/v1/completions", {"prompt": "hello world", "max_tokens": 8, "logit_bias": {"100": 2}, "frequency_penalty": 1.5,
                         "presence_penalty": 0.5, "min_tokens": 3}),
    ("/v1/completions", {"prompt": "hello world", "max_tokens": 12, "allowed_token_ids": [40, 41, 42, 43, 44, 45, 46, 47]}),
    ("/v1/completions", {"prompt": "hello world", "max_tokens": 8, "bad_words": ["56", "Q", " hello"]}),
    ("/v1/completions", {"prompt": "hello world", "max_tokens": 8, "bad_words": ["56", "Q"], "min_tokens": 5}),
    ("/v1/completions", {"prompt": "hello world", "max_tokens": 12, "bad_words": ["prefix", " prefix\n", "56Q"]}),
    ("/v1/completions", {"prompt": "hello world", "max_tokens": 4, "logprobs": 2, "logit_bias": {"100": 100}}),
    ("/v1/completions", {"prompt": ["hello world", "abc"], "max_tokens": 3}),
    ("/v1/completions", {"prompt": "hello world, how are you", "max_tokens": 2, "truncate_prompt_tokens": 3}),
    ("/v1/completions", {"prompt": "hello world, how are you", "max_tokens": 2, "truncate_prompt_tokens": 3, "truncation_side": "right"}),
    ("/v1/completions", {"prompt": "hello world, how are you", "max_tokens": 2, "truncate_prompt_tokens": -1}),
    ("/v1/completions", {"prompt": [5, 6, 7, 8, 9], "max_tokens": 2, "truncate_prompt_tokens": 3}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 3, "truncate_prompt_tokens": 3}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "logit_bias": {"50": 8},
                              "bad_words": ["b"]}),
    ("/v1/completions", {"prompt": "hello world", "max_tokens": 2, "request_id": "r" * 300}),
    # refused: not streamed a 400, streamed an error event (or a 400 before the stream)
    *[(path, {**body, "stream": stream}) for stream in (False, True) for path, body in [
        ("/v1/completions", {"prompt": "hello world", "max_tokens": 4, "logit_bias": {"600": 1}}),
        ("/v1/completions", {"prompt": "hello world", "max_tokens": 4, "logit_bias": {"abc": 1, "x": 2}}),
        ("/v1/completions", {"prompt": "hello world", "max_tokens": 4, "allowed_token_ids": []}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "allowed_token_ids": [1, 600]}),
        ("/v1/completions", {"prompt": "hello world", "max_tokens": 4, "bad_words": [""]}),
        ("/v1/completions", {"prompt": "hello world", "max_tokens": 4, "stop_token_ids": [-1]}),
        ("/v1/completions", {"prompt": "hello world", "max_tokens": 4, "stop_token_ids": [2**31]}),
        ("/v1/completions", {"prompt": "hello world", "max_tokens": 4, "stop_token_ids": [2**40]}),
        ("/v1/completions", {"prompt": "hello world", "max_tokens": 4, "stop_token_ids": [2**70]}),
        ("/v1/completions", {"prompt": "hello world", "max_tokens": 4, "bad_words": [f"w{i}" for i in range(70)]}),
        ("/v1/completions", {"prompt": "hello world", "max_tokens": 4, "truncate_prompt_tokens": 0}),
        ("/v1/completions", {"prompt": "hello world", "max_tokens": 4, "truncate_prompt_tokens": M_LEN + 1}),
    ]],
]


def answer(base_url: str, path: str, body: dict, model: str) -> tuple[int, object]:
    """(status, what of the answer both engines must agree on)."""
    full = {"model": model, "temperature": 0, "return_token_ids": True, **body}
    req = urllib.request.Request(base_url + path, json.dumps(full).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            status, data = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, data = e.code, e.read().decode()
    if data.startswith("data: "):
        events = [json.loads(line[6:]) for line in data.split("\n") if line.startswith("data: ") and line != "data: [DONE]"]
        errors = [e["error"] for e in events if "error" in e]
        ids = sorted((c["index"], t) for e in events for c in e.get("choices", []) for t in c.get("token_ids") or [])
        return status, {"errors": errors, "token_ids": ids}
    d = json.loads(data)
    if "error" in d:
        return status, d["error"]
    choices = [{"index": c["index"], "token_ids": c["token_ids"], "finish_reason": c["finish_reason"],
                "prompt_token_ids": c.get("prompt_token_ids"),
                "logprobs": c["logprobs"] and c["logprobs"].get("token_logprobs")} for c in d["choices"]]
    return status, {"id": d["id"] if "request_id" in body else None, "choices": choices, "usage": d["usage"]["prompt_tokens"],
                    "prompt_token_ids": d.get("prompt_token_ids")}


def same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, abs_tol=1e-3)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.mark.compare
@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_vllm_and_kvpool_answer_the_request_contract_alike(real_vllm, tiny_checkpoint, tmp_path):
    model = str(tiny_checkpoint)
    port = free_port()
    env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "DO_NOT_TRACK": "1", "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    cmd = [str(real_vllm / ".venv-vllm/bin/vllm"), "serve", model, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--max-model-len", str(M_LEN), "--seed", "0"]
    with Server("vllm", cmd, env, tmp_path / "vllm.log", port) as vllm:
        vllm.wait_ready(600)
        expected = [answer(vllm.url, path, body, model) for path, body in REQUESTS]
    with kvpool_serve(model, tmp_path / "kvpool", "--dtype", "float32", "--max-model-len", str(M_LEN)) as served:
        got = [answer(served.base_url, path, body, model) for path, body in REQUESTS]
    differ = [(req, e, g) for req, e, g in zip(REQUESTS, expected, got, strict=True) if not same(e, g)]
    assert not differ, "\n".join(f"{req}\n  vllm   {e}\n  kvpool {g}" for req, e, g in differ)
