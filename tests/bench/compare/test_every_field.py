"""Issue 23's bar across every area at once, held against vLLM itself (``-m compare``): the same requests, field by
field, sent to ``vllm serve`` 0.32 and ``kvpool serve`` on the same checkpoint with the
same settings (float32, greedy) must get the same status code and, when served, the same
token ids, text, finish reasons and usage, logprobs (sampled, top-k and prompt) within
1e-3. Both servers run at once on free ports, and are stopped when the module ends."""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request

import pytest

from bench.compare.servers import Server, ServerConfig, free_port, server_command, vllm_env

# Every test here runs both engines (minutes): selected with -m compare only.
pytestmark = [pytest.mark.compare, pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(1800)]
CFG = ServerConfig(block_size=32, num_blocks=256, max_model_len=512, kv_cache_metrics=False)
NAME = "tiny"
PROMPT = "The cache keeps every block it has seen until the pool runs dry"
CHAT = [{"role": "user", "content": "Which block goes first when the pool is full?"}]


@pytest.fixture(scope="module")
def engines(real_vllm, tmp_path_factory):
    from bench.compare.checkpoints import checkpoint_dir

    model = checkpoint_dir("tiny")
    tmp = tmp_path_factory.mktemp("contract")
    servers = {}
    for engine in ("vllm", "kvpool"):
        port = free_port()
        env = vllm_env(tmp / "cache", CFG, model, 1) if engine == "vllm" else {}
        cmd = server_command(engine, model, port, CFG, real_vllm, NAME)
        servers[engine] = Server(engine, cmd, env, tmp / f"{engine}.log", port)
    try:
        for s in servers.values():
            s.__enter__()
        for s in servers.values():
            s.wait_ready(600)
        yield servers
    finally:
        for s in servers.values():
            s.stop()


def post(url: str, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url + path, data=json.dumps({"model": NAME, **body}).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def stream(url: str, path: str, body: dict) -> tuple[int, list[dict]]:
    """A streamed answer's chunks, less what differs by nature (id, created)."""
    req = urllib.request.Request(url + path, data=json.dumps({"model": NAME, **body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            lines = r.read().decode().splitlines()
            status = r.status
    except urllib.error.HTTPError as e:
        return e.code, [json.loads(e.read() or b"{}")]
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    for c in chunks:
        c.pop("id", None), c.pop("created", None)
    return status, chunks


def both(engines, path: str, body: dict) -> tuple[dict, dict]:
    (vs, v), (ks, k) = (post(engines[e].url, path, body) for e in ("vllm", "kvpool"))
    assert vs == ks, f"status: vLLM {vs} {v}, kvpool {ks} {k}"
    return v, k


def close(a, b, path="$") -> None:
    """Equal JSON, floats within 1e-3 (logprobs), -inf/None alike."""
    if isinstance(a, float) or isinstance(b, float):
        assert a is not None and b is not None, f"{path}: {a} vs {b}"
        if math.isinf(a) or math.isinf(b):
            assert a == b, f"{path}: {a} vs {b}"
        else:
            assert abs(a - b) <= 1e-3, f"{path}: {a} vs {b}"
    elif isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), f"{path}: keys {sorted(a.keys() ^ b.keys())}"
        for key in a:
            close(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), f"{path}: {len(a)} vs {len(b)} items"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            close(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"


def same_choices(v: dict, k: dict) -> None:
    """Both answers whole, less what differs by nature: the ids, the time, and the
    system_fingerprint's value (each engine's own; both must have one)."""
    assert isinstance(v.get("system_fingerprint"), str) and isinstance(k.get("system_fingerprint"), str)
    strip = ("id", "created", "system_fingerprint")
    close({x: y for x, y in v.items() if x not in strip}, {x: y for x, y in k.items() if x not in strip}, "answer")


GREEDY = {"temperature": 0, "return_token_ids": True}
COMPLETIONS = {
    "plain": {"max_tokens": 12},
    "logprobs": {"max_tokens": 6, "logprobs": 3},
    "echo_logprobs_no_output": {"max_tokens": 0, "echo": True, "logprobs": 2},
    "echo_logprobs": {"max_tokens": 4, "echo": True, "logprobs": 1},
    "prompt_logprobs": {"max_tokens": 3, "prompt_logprobs": 2},
    "logit_bias": {"max_tokens": 6, "logit_bias": {"300": 100}},
    "logit_bias_negative": {"max_tokens": 6, "logit_bias": {"300": -100, "301": -50}},
    "allowed_token_ids": {"max_tokens": 6, "allowed_token_ids": [40, 41, 300, 301]},
    "bad_words": {"max_tokens": 8, "bad_words": ["the", "cache block"]},
    "truncate": {"max_tokens": 5, "truncate_prompt_tokens": 6},
    "penalties": {"max_tokens": 10, "repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.7},
    "min_tokens_ignore_eos": {"max_tokens": 8, "min_tokens": 8, "ignore_eos": True},
    "stop_token_ids": {"max_tokens": 12, "stop_token_ids": [300, 301, 302, 303, 304, 305]},
    "n2_seeded": {"max_tokens": 5, "n": 2, "temperature": 1.0, "seed": 11, "top_k": 1},
    "over_what_the_prompt_leaves": {"prompt": [7] * 500, "max_tokens": 100, "ignore_eos": True},
    "regex": {"max_tokens": 12, "structured_outputs": {"regex": "[a-c]{3}-[0-9]{2}"}},
    "choice": {"max_tokens": 12, "structured_outputs": {"choice": ["pool", "cache block", "evict"]}},
    "json_schema": {"max_tokens": 40, "response_format": {"type": "json_schema", "json_schema": {"name": "b", "schema": {
        "type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}}}},
}
CHATS = {
    "plain": {"max_tokens": 10},
    "logprobs": {"max_tokens": 5, "logprobs": True, "top_logprobs": 2},
    "echo_continue": {"max_tokens": 5, "echo": True, "add_generation_prompt": False, "continue_final_message": True,
                      "messages": CHAT + [{"role": "assistant", "content": "The least"}]},
    "truncate": {"max_tokens": 5, "truncate_prompt_tokens": 12},
    "bad_words": {"max_tokens": 8, "bad_words": ["the"]},
}
STREAMS = {
    "completion": ("/v1/completions", {"prompt": PROMPT, "max_tokens": 6}),
    "completion_logprobs_usage": ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "logprobs": 2,
                                                      "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
    "completion_echo_ids": ("/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "echo": True, "return_token_ids": True}),
    "chat": ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 6, "stream_options": {"include_usage": True}}),
    "chat_logprobs_ids": ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "logprobs": True, "top_logprobs": 2,
                                                   "return_token_ids": True}),
    "chat_continuous_usage": ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 3,
                                                       "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
}
REFUSED = {
    "logit_bias_out_of_vocab": {"logit_bias": {"10000000": 1}},
    "allowed_token_ids_out_of_vocab": {"allowed_token_ids": [10000000]},
    "truncate_below_minus_one": {"truncate_prompt_tokens": -2},
    "prompt_logprobs_too_many": {"prompt_logprobs": 100},
    "stop_token_id_huge": {"stop_token_ids": [2**40]},
    "bad_regex": {"structured_outputs": {"regex": "(unclosed"}},
    "two_constraints": {"structured_outputs": {"regex": "a", "choice": ["a"]}},
    "max_tokens_zero_without_echo": {"max_tokens": 0},
    "max_tokens_over_the_context": {"max_tokens": 600},
    "prompt_over_the_context": {"prompt": [7] * 600},
    "n_greedy": {"n": 2, "temperature": 0},
}


@pytest.mark.parametrize("case", list(COMPLETIONS))
def test_a_completion_answers_as_vllm(engines, case):
    v, k = both(engines, "/v1/completions", {"prompt": PROMPT, **GREEDY, **COMPLETIONS[case]})
    same_choices(v, k)


@pytest.mark.parametrize("case", list(CHATS))
def test_a_chat_answers_as_vllm(engines, case):
    body = {"messages": CHAT, **GREEDY, **CHATS[case]}
    v, k = both(engines, "/v1/chat/completions", body)
    same_choices(v, k)


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_bad_field_gets_vllms_status(engines, case):
    v, k = both(engines, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, **REFUSED[case]})
    assert k["error"]["message"], k


@pytest.mark.parametrize("case", list(STREAMS))
def shape(chunks: list[dict]) -> dict:
    """A stream as both engines must agree on it whatever its chunking (vLLM coalesces
    tokens into one chunk when its output queue runs ahead): each kind of chunk's keys
    (its choice's and usage's too), and per choice the joined text, token ids and
    logprobs, the finish and stop reasons; the last usage."""
    kinds, out, last_usage = set(), {}, None

    def keys(d) -> tuple:
        return tuple(sorted(d)) if isinstance(d, dict) else ()

    for c in chunks:
        if not c.get("choices"):
            kinds.add(("usage", keys(c), keys(c.get("usage"))))
            last_usage = c.get("usage")
            continue
        for ch in c["choices"]:
            delta = ch.get("delta", {})
            kind = "role" if "role" in delta else "finish" if ch.get("finish_reason") else "content"
            kinds.add((kind, keys(c), keys(ch), keys(c.get("usage"))))
            one = out.setdefault(ch["index"], {"text": "", "token_ids": [], "logprobs": [], "finish": None, "stop": None})
            one["text"] += ch.get("text", delta.get("content") or "")
            one["token_ids"] += ch.get("token_ids") or []
            lp = ch.get("logprobs")
            if lp:
                one["logprobs"] += lp.get("content") or [list(t) for t in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True)]
            if ch.get("finish_reason"):
                one["finish"], one["stop"] = ch["finish_reason"], ch.get("stop_reason")
    return {"kinds": sorted(kinds), "choices": out, "usage": last_usage}


@pytest.mark.parametrize("case", list(STREAMS))
def test_a_stream_is_vllms_whatever_its_chunking(engines, case):
    path, body = STREAMS[case]
    (vs, v), (ks, k) = (stream(engines[e].url, path, {**body, "temperature": 0}) for e in ("vllm", "kvpool"))
    assert vs == ks == 200
    close(shape(v), shape(k), "stream")
