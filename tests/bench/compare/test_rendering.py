"""Tokenizing, chat templates and detokenizing: the same requests to `vllm serve` and
`kvpool serve` of a checkpoint with a SentencePiece-style (Metaspace) tokenizer
(tests/kvtest/local_tokenizers.py) get the same answers -- status, greedy text (the
leading space included), prompt token counts, /tokenize's ids, error messages. Marked
``compare`` (needs ``.venv-vllm``, selected with ``-m compare``)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

U = [{"role": "user", "content": "hi"}]
GREEDY = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
CASES = [
    ("/v1/completions", {"prompt": "the cat", **GREEDY}),
    ("/v1/completions", {"prompt": "the cat", **GREEDY, "skip_special_tokens": False, "spaces_between_special_tokens": False}),
    ("/v1/chat/completions", {"messages": U, **GREEDY}),
    ("/v1/chat/completions", {"messages": U, **GREEDY, "add_special_tokens": True}),
    ("/v1/chat/completions", {"messages": U + [{"role": "assistant", "content": "the cat"}], **GREEDY, "echo": True,
                              "add_generation_prompt": False, "continue_final_message": True}),
    ("/v1/chat/completions", {"messages": U, **GREEDY, "echo": True}),
    ("/v1/chat/completions", {"messages": U, **GREEDY, "continue_final_message": True}),
    ("/v1/chat/completions", {"messages": U, **GREEDY, "continue_final_message": True, "add_generation_prompt": True}),
    ("/v1/chat/completions", {"messages": U, **GREEDY, "chat_template": "{{ messages[0].content }}"}),
    ("/v1/chat/completions", {"messages": U, **GREEDY, "chat_template_kwargs": {"chat_template": "x"}}),
    ("/v1/chat/completions", {"messages": U, **GREEDY, "chat_template_kwargs": {"messages": []}}),
    ("/v1/chat/completions", {"messages": U, **GREEDY, "chat_template_kwargs": {"add_generation_prompt": False}}),
    ("/v1/chat/completions", {"messages": U, **GREEDY, "chat_template_kwargs": {"tools": [{"type": "function"}], "tokenize": True}}),
    ("/v1/chat/completions", {"messages": U, **GREEDY, "chat_template_kwargs": {"conversation": []}}),
    ("/v1/chat/completions", {"messages": U, **GREEDY, "mm_processor_kwargs": {"a": 1}}),
    ("/v1/chat/completions", {"messages": U, **GREEDY, "media_io_kwargs": {"image": {}}}),
    ("/v1/chat/completions", {"messages": [{"role": "developer", "content": "be nice"}, *U], **GREEDY}),
    ("/v1/chat/completions", {"messages": U, **GREEDY, "documents": [{"title": "a", "text": "b"}]}),
    ("/tokenize", {"messages": U, "add_special_tokens": True}),
    ("/tokenize", {"messages": [*U, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": [{"type": "text", "text": "42"}], "tool_call_id": "a"}]}),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}),
    ("/tokenize", {"prompt": "in 2024 there were 12345 cats"}),
]


def answer(base_url: str, path: str, body: dict) -> tuple:
    """What must be equal: the status, then each choice's text and the prompt's length,
    the error's message and param, or /tokenize's ids."""
    req = urllib.request.Request(base_url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            status, got = r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        status, got = e.code, json.loads(e.read())
    if "error" in got:
        return status, got["error"]["message"], got["error"]["param"]
    if "tokens" in got:
        return status, got["tokens"]
    texts = [c["text"] if "text" in c else c["message"]["content"] for c in got["choices"]]
    return status, texts, got["usage"]["prompt_tokens"]


def differences(vllm_url: str, kvpool_url: str) -> list[str]:
    out = []
    for path, body in CASES:
        v, k = answer(vllm_url, path, body), answer(kvpool_url, path, body)
        if v != k:
            out.append(f"{path} {json.dumps(body)[:150]}\n  vllm:   {v}\n  kvpool: {k}")
    return out


@pytest.mark.compare
@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_vllm_and_kvpool_render_and_detokenize_alike(real_vllm: Path, tiny_checkpoint, tmp_path):
    from kvtest.local_tokenizers import metaspace_checkpoint

    from bench.compare.servers import Server, ServerConfig, free_port, server_command, vllm_env

    model = metaspace_checkpoint(tiny_checkpoint, tmp_path / "metaspace")
    cfg = ServerConfig(num_blocks=64, max_model_len=1024)
    ports = {"vllm": free_port(), "kvpool": free_port()}
    env = {"vllm": vllm_env(tmp_path / "cache", cfg, model, 1) | {"OMP_NUM_THREADS": "1"}, "kvpool": {}}
    servers = {e: Server(e, server_command(e, model, ports[e], cfg, real_vllm, str(model)), env[e], tmp_path / f"{e}.log", ports[e])
               for e in ("vllm", "kvpool")}
    with servers["vllm"] as v, servers["kvpool"] as k:
        v.wait_ready(600)
        k.wait_ready(120)
        assert differences(v.url, k.url) == []
