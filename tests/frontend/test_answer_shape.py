"""The shape of every answer, key for key, as vLLM 0.32 serializes it (recorded from a
live ``vllm serve`` of the tiny checkpoint; ``tests/bench/compare/test_every_field.py``
holds kvpool to it live with ``-m compare``): whole answers carry vLLM's null fields;
a stream's chunks leave out what vLLM leaves unset (a chat chunk's stop_reason until it
finishes, usage's null details); the system_fingerprint rides on the last message only."""

from __future__ import annotations

import pytest
from kvtest.http_api import post, post_stream

# vLLM 0.32's keys, as its answers to the same requests had them.
COMPLETION = {"id", "object", "created", "model", "choices", "service_tier", "system_fingerprint", "usage",
              "kv_transfer_params", "ec_transfer_params", "metrics"}
COMPLETION_CHOICE = {"index", "text", "logprobs", "finish_reason", "stop_reason", "token_ids", "prompt_logprobs",
                     "prompt_token_ids", "routed_experts"}
CHAT = {"id", "object", "created", "model", "choices", "service_tier", "system_fingerprint", "usage", "prompt_logprobs",
        "prompt_token_ids", "prompt_text", "kv_transfer_params", "ec_transfer_params", "metrics"}
CHAT_CHOICE = {"index", "message", "logprobs", "finish_reason", "stop_reason", "token_ids", "routed_experts"}
CHAT_MESSAGE = {"role", "content", "refusal", "annotations", "audio", "function_call", "reasoning"}
USAGE = {"prompt_tokens", "total_tokens", "completion_tokens", "prompt_tokens_details", "completion_tokens_details"}


@pytest.fixture
def front(served, model):
    """The live kvpool serve of this folder's tests (tokens stream one by one; it has
    --enable-prompt-tokens-details, so a final usage carries its details)."""
    served.model = model
    return served


def whole(front, path: str, body: dict) -> dict:
    status, answer = post(front, path, {"model": front.model, "ignore_eos": True, **body})
    assert status == 200, answer
    return answer


def chunks(front, path: str, body: dict) -> list[dict]:
    return post_stream(front, path, {"model": front.model, "ignore_eos": True, "stream": True, **body})


def test_whole_answers_have_vllms_keys(front):
    c = whole(front, "/v1/completions", {"prompt": "hello", "max_tokens": 3})
    assert set(c) == COMPLETION and set(c["choices"][0]) == COMPLETION_CHOICE and set(c["usage"]) == USAGE
    assert c["system_fingerprint"].startswith("kvpool-")
    chat = whole(front, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert set(chat) == CHAT and set(chat["choices"][0]) == CHAT_CHOICE and set(chat["usage"]) == USAGE
    assert set(chat["choices"][0]["message"]) == CHAT_MESSAGE
    assert chat["system_fingerprint"] == c["system_fingerprint"]  # one server, one fingerprint


@pytest.mark.parametrize("include_usage", [False, True])
def test_a_chat_stream_leaves_out_what_vllm_leaves_unset(front, include_usage):
    options = {"include_usage": True, "continuous_usage_stats": True} if include_usage else {}
    # 8 tokens: a sampled token that ends inside a UTF-8 character sends no chunk of its own
    got = chunks(front, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                                                 "stream_options": options})
    role, *content, last = [c for c in got if c["choices"]]
    assert set(role["choices"][0]) == {"index", "delta", "logprobs", "finish_reason"}
    assert content and all(set(c["choices"][0]) == {"index", "delta", "logprobs", "finish_reason", "token_ids"} for c in content)
    assert set(last["choices"][0]) == {"index", "delta", "logprobs", "finish_reason", "stop_reason", "token_ids"}
    with_fingerprint = [i for i, c in enumerate(got) if "system_fingerprint" in c]
    if include_usage:
        final = got[-1]
        assert final["choices"] == [] and set(final["usage"]) == {"prompt_tokens", "total_tokens", "completion_tokens",
                                                                  "prompt_tokens_details"}
        assert with_fingerprint == [len(got) - 1]  # the usage chunk is the last message
        assert all(set(c["usage"]) == {"prompt_tokens", "total_tokens", "completion_tokens", "completion_tokens_details"}
                   for c in got[:-1])
    else:
        assert with_fingerprint == [len(got) - 1] and got[-1]["choices"][0]["finish_reason"] == "length"


def test_a_completion_stream_puts_the_fingerprint_on_its_finishing_chunk(front):
    got = chunks(front, "/v1/completions", {"prompt": "hello", "max_tokens": 3, "n": 2, "temperature": 1.0,
                                            "stream_options": {"continuous_usage_stats": True, "include_usage": False}})
    finishing = [i for i, c in enumerate(got) if c["choices"][0]["finish_reason"]]
    assert len(finishing) == 2 and [i for i, c in enumerate(got) if "system_fingerprint" in c] == finishing
