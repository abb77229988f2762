"""--enable-prompt-tokens-details, as vLLM 0.32 (checked against `vllm serve`): only with
it does a final usage carry ``prompt_tokens_details`` (``cached_tokens``, what the
scheduler reported; ``created_cache_tokens`` and ``multimodal_tokens`` null), else
the key is null (left out of a stream's usage, as vLLM serializes it) -- completions
and chat, whole and streamed. A continuous-usage chunk never has it. The fake scheduler reports 16 cached tokens for every request."""

from __future__ import annotations

import pytest
from kvtest.fake_engine import fake_engine, frontend_process
from kvtest.http_api import post, post_stream

DETAILS = {"cached_tokens": 16, "created_cache_tokens": None, "multimodal_tokens": None}


@pytest.fixture(scope="module", params=["with", "without"])
def front(request, tiny_checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("details") / "frontend.log"
    flags = ("--enable-prompt-tokens-details",) if request.param == "with" else ()
    with fake_engine(num_cached_tokens=16) as engine, frontend_process(tiny_checkpoint, engine, log, *flags) as f:
        f.expected = DETAILS if request.param == "with" else None
        yield f


REQUESTS = [("/v1/completions", {"prompt": "hello there"}), ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})]


@pytest.mark.parametrize(("path", "body"), REQUESTS, ids=["completion", "chat"])
def test_a_whole_answer(front, tiny_checkpoint, path, body):
    status, answer = post(front, path, {**body, "model": str(tiny_checkpoint), "max_tokens": 3})
    assert status == 200
    usage = answer["usage"]
    assert usage["prompt_tokens_details"] == front.expected and usage["completion_tokens"] == 3


@pytest.mark.parametrize(("path", "body"), REQUESTS, ids=["completion", "chat"])
def test_a_stream_with_usage(front, tiny_checkpoint, path, body):
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = post_stream(front, path, {**body, "model": str(tiny_checkpoint), "max_tokens": 3, "stream": True, "stream_options": options})
    final = chunks[-1]
    # NOTE: vLLM serializes a stream's usage without its null keys (checked against a live vllm serve)
    assert final["choices"] == [] and final["usage"].get("prompt_tokens_details", None) == front.expected
    assert ("prompt_tokens_details" in final["usage"]) == (front.expected is not None)
    continuous = [c["usage"] for c in chunks[:-1] if "usage" in c]
    assert continuous and all("prompt_tokens_details" not in u for u in continuous)
