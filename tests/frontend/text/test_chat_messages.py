"""frontend.text.chat_messages: the messages a chat template sees, field for field as vLLM
0.32's ``parse_chat_messages`` ("string" content format) builds them -- worked out by
hand from ``vllm/renderers/chat_utils.py``."""

from __future__ import annotations

import pytest

from frontend.schema.errors import APIError
from frontend.text.chat_messages import conversation


def test_text_parts_are_joined_and_a_missing_content_is_empty():
    got = conversation([
        {"role": "user", "content": ["a", {"type": "text", "text": "b"}, {"type": "input_text", "text": "c"}, {"type": "text", "text": None}]},
        {"role": "assistant", "content": None},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}, {"type": "thinking", "thinking": "hm"}]},
    ])
    assert got == [{"role": "user", "content": "a\nb\nc"}, {"role": "assistant", "content": ""},
                   {"role": "assistant", "content": "no\nhm"}]


def test_only_the_fields_vllm_keeps_reach_the_template():
    got = conversation([
        {"role": "user", "content": "x", "name": "ann", "task": 3, "weight": 1, "tool_call_id": "t"},
        {"role": "tool", "content": "42", "tool_call_id": "call-1", "name": None},
        {"role": "developer", "content": "d"},
        {"role": "assistant", "content": "y", "reasoning": "because", "tool_calls": []},
    ])
    assert got == [
        {"role": "user", "content": "x", "name": "ann"},
        {"role": "tool", "content": "42", "tool_call_id": "call-1"},
        {"role": "developer", "content": "d", "tools": None},
        {"role": "assistant", "content": "y", "reasoning": "because", "reasoning_content": "because"},
    ]


def test_tool_call_arguments_become_a_dict():
    calls = [{"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
             {"id": "2", "function": {"name": "g", "arguments": "not json"}},
             {"id": "3", "function": {"name": "h", "arguments": "[1]"}},
             {"id": "4", "function": {"name": "k", "arguments": ""}}]
    sent = [{"role": "assistant", "content": None, "tool_calls": calls}]
    got = conversation(sent)[0]["tool_calls"]
    assert [c["function"]["arguments"] for c in got] == [{"a": 1}, {}, {}, {}]
    assert calls[0]["function"]["arguments"] == '{"a": 1}'  # the request itself is left as it came


@pytest.mark.parametrize(("message", "error"), [
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "only text content parts"),
    ({"content": "x"}, "has no role"),
    ({"role": "assistant", "content": "", "tool_calls": ["x"]}, "assistant tool_calls entries must be objects."),
    ({"role": "assistant", "content": "", "tool_calls": [{"type": "custom", "function": {}}]},
     "chat completions only support assistant tool_calls of type 'function'."),
])
def test_what_cannot_be_rendered_is_refused(message, error):
    with pytest.raises(APIError, match=error):
        conversation([message])
