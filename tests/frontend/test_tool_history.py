"""Earlier tool calls in the messages reach the chat template with their arguments
as objects (vLLM 0.32's renderers/chat_utils._postprocess_messages, read by hand)."""

from __future__ import annotations

import pytest

from frontend.chat_template import render_chat
from frontend.errors import APIError
from frontend.tool_history import with_tool_call_arguments


def call(arguments, **extra):
    return {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}, **extra}


def test_arguments_become_objects_and_the_request_is_left_alone():
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [call('{"city": "Paris"}'), call(""), call({"a": 1})]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]  # fmt: skip
    out = with_tool_call_arguments(messages)
    assert [c["function"]["arguments"] for c in out[1]["tool_calls"]] == [{"city": "Paris"}, {}, {"a": 1}]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    assert out[0] is messages[0] and out[2] is messages[2]


@pytest.mark.parametrize("arguments", ["{not json", "[1, 2]", "42", None])
def test_arguments_that_are_no_object_become_an_empty_one(arguments):
    out = with_tool_call_arguments([{"role": "assistant", "tool_calls": [call(arguments)]}])
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {}


def test_an_empty_tool_calls_is_dropped_and_bad_entries_are_refused():
    assert with_tool_call_arguments([{"role": "assistant", "content": "x", "tool_calls": []}]) == [{"role": "assistant", "content": "x"}]
    with pytest.raises(APIError) as e:
        with_tool_call_arguments([{"role": "assistant", "tool_calls": ["x"]}])
    assert e.value.message == "assistant tool_calls entries must be objects. (parameter=tool_calls)"
    with pytest.raises(APIError) as e:
        with_tool_call_arguments([{"role": "assistant", "tool_calls": [{"type": "custom", "function": {}}]}])
    assert e.value.message == "chat completions only support assistant tool_calls of type 'function'. (parameter=tool_calls)"


def test_a_template_reads_the_arguments_fields():
    template = "{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.function.name }}({{ c.function.arguments.city }}){% endfor %}{% endfor %}"
    messages = with_tool_call_arguments([{"role": "assistant", "tool_calls": [call('{"city": "Paris"}')]}])
    assert render_chat(template, messages, {}, add_generation_prompt=False) == "get_weather(Paris)"
