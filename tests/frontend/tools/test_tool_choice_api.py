"""tools and tool_choice against a live `kvpool serve`, with and without
--enable-auto-tool-choice --tool-call-parser hermes: the status and words per
tool_choice, and the answer's shape (as a live vLLM 0.32 served the same requests).
The random tiny model writes no calls, so every answer here is text; the calls'
answer building is tests/frontend/tools/test_tool_calls.py."""

from __future__ import annotations

import json

import pytest
from kvtest.http_api import post

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "w",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# The tiny checkpoint's template with the tools written first, as transformers' tojson writes them.
TEMPLATE = ("{{ bos_token }}{% if tools %}TOOLS{{ tools | tojson }}{% endif %}{% for message in messages %}<|{{ message['role'] }}|>"
            "{{ message['content'] }}{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def hermes(tiny_checkpoint, tmp_path_factory):
    from kvtest.serve import kvpool_serve

    with kvpool_serve(tiny_checkpoint, tmp_path_factory.mktemp("serve-logs"), "--max-model-len", "1024",
                      "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--chat-template", TEMPLATE,
                      "--exclude-tools-when-tool-choice-none") as s:
        yield s


def chat(served, model, **fields):
    return post(served, "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **fields})


@pytest.mark.parametrize("fields,message", [
    ({"tools": TOOLS}, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'),
    ({"tools": TOOLS, "tool_choice": "auto"}, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'),
    ({"tools": TOOLS, "tool_choice": "required"}, 'tool_choice="required" requires --tool-call-parser to be set'),
    ({"tools": TOOLS, "tool_choice": NAMED}, 'tool_choice=function "get_weather" requires --tool-call-parser to be set'),
])
def test_without_the_flags_a_tool_choice_is_refused_naming_them(served, model, fields, message):
    status, body = chat(served, model, **fields)
    assert status == 400 and body["error"]["message"] == message and body["error"]["type"] == "BadRequestError"


def test_without_the_flags_none_answers_text(served, model):
    status, body = chat(served, model, tools=TOOLS, tool_choice="none")
    assert status == 200
    # vLLM 0.32's ChatMessage: no tool_calls key without a call, its other fields null
    assert set(body["choices"][0]["message"]) == {"role", "content", "refusal", "annotations", "audio", "function_call", "reasoning"}
    assert body["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("choice", ["none", "auto", "required", NAMED, None])
def test_with_hermes_every_tool_choice_is_served(hermes, model, choice):
    fields = {"tools": TOOLS} if choice is None else {"tools": TOOLS, "tool_choice": choice}
    status, body = chat(hermes, model, **fields)
    assert status == 200, body
    c = body["choices"][0]
    # NOTE: without a call, vLLM 0.32 leaves tool_calls out of the message
    assert c["finish_reason"] == "length" and isinstance(c["message"]["content"], str) and "tool_calls" not in c["message"]


def test_with_hermes_a_bad_request_is_still_refused_in_vllms_words(hermes, model):
    status, body = chat(hermes, model, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    assert status == 400 and body["error"]["param"] == "tool_choice"
    assert body["error"]["message"] == "The tool specified in `tool_choice` does not match any of the specified `tools` (parameter=tool_choice)"


def test_with_hermes_a_stream_through_the_openai_sdk(hermes, model):
    import openai

    client = openai.OpenAI(base_url=hermes.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    chunks = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
                                                 tool_choice="auto", max_tokens=4, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(not c.choices[0].delta.tool_calls for c in chunks)
    whole = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], tools=TOOLS, max_tokens=4, temperature=0)
    assert whole.choices[0].message.tool_calls is None and whole.choices[0].finish_reason == "length"


def prompt_text(served, model, **fields) -> str:
    status, body = post(served, "/v1/chat/completions/render", {"model": model, "messages": [{"role": "user", "content": "hi"}], **fields})
    assert status == 200, body
    status, body = post(served, "/detokenize", {"model": model, "tokens": body["token_ids"]})
    return body["prompt"]


def test_the_template_sees_the_tools_as_vllm_dumps_them_and_none_hides_them(hermes, model):
    # vllm/renderers/online_renderer.py: tool.model_dump() of each tool, None under
    # --exclude-tools-when-tool-choice-none with tool_choice "none"
    tools = [{"type": "function", "function": {"name": "f", "extra": 1}}]
    shown = prompt_text(hermes, model, tools=tools, tool_choice="auto")
    assert 'TOOLS[{"type": "function", "function": {"name": "f", "description": null, "parameters": null}}]<|user|>hi' in shown  # /detokenize keeps specials, as vLLM's
    assert "TOOLS" not in prompt_text(hermes, model, tools=tools, tool_choice="none")


def test_tokenize_shows_the_tools_to_the_template(hermes, model):
    # vllm/entrypoints/serve/tokenize/protocol.py TokenizeChatRequest.tools, dumped as for a chat
    tools = [{"type": "function", "function": {"name": "f"}}]
    messages = [{"role": "user", "content": "hi"}]
    status, with_tools = post(hermes, "/tokenize", {"model": model, "messages": messages, "tools": tools})
    status2, without = post(hermes, "/tokenize", {"model": model, "messages": messages})
    assert status == status2 == 200 and with_tools["count"] > without["count"]
    _, text = post(hermes, "/detokenize", {"model": model, "tokens": with_tools["tokens"]})
    assert 'TOOLS[{"type": "function", "function": {"name": "f", "description": null, "parameters": null}}]' in text["prompt"]
    status, body = post(hermes, "/tokenize", {"model": model, "messages": messages, "tools": [{"type": "function"}]})
    assert status == 400 and body["error"]["param"] == "body.tools.0.function"


BOOL_TOOL = [{"type": "function", "function": {"name": "set_flag", "description": "f", "strict": True, "parameters": {
    "type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"], "additionalProperties": False}}}]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "set_flag"}}], ids=["required", "named"])
def test_with_hermes_a_forced_call_is_a_valid_call(hermes, model, choice):
    # The random model writes whatever the grammar lets it: forced through vLLM's
    # structural tag, the answer can only be a call of the tool, with schema-valid
    # arguments for a strict tool (a boolean leaves the grammar no room to run long;
    # vLLM leaves a non-strict tool's arguments free).
    status, body = chat(hermes, model, tools=BOOL_TOOL, tool_choice=choice, max_tokens=200, temperature=0)
    assert status == 200, body
    c = body["choices"][0]
    calls = c["message"].get("tool_calls")
    assert calls, c
    assert [call["function"]["name"] for call in calls] == ["set_flag"] * len(calls)
    assert all(json.loads(call["function"]["arguments"]) in ({"on": True}, {"on": False}) for call in calls)
    assert all(call["id"].startswith("chatcmpl-tool-") and call["type"] == "function" for call in calls)
