"""The chat answer built from a parser's reading of the model's text (vLLM 0.32's
chat_completion/serving.py: chat_completion_full_generator and the stream generator;
parser/abstract_parser.py: DelegatingParser). The tiny model writes no calls by
itself, so its text is given here; tests/frontend/tools/test_tool_choice_api.py runs a
live server."""

from __future__ import annotations

import json

import msgspec
import pytest

from frontend.schema.errors import APIError
from frontend.schema.requests import ChatCompletionRequest
from frontend.tools.calls import StreamedToolCalls, chat_message
from frontend.tools.choice import check_tool_parsing, check_tool_usage, template_tools
from frontend.tools.constraint import adjust_request
from frontend.tools.parsers.hermes import HermesToolParser

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "get_time"}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
TWO_CALLS = ('ok<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
             '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')


def request(**fields) -> ChatCompletionRequest:
    req = msgspec.convert({"messages": [{"role": "user", "content": "hi"}], **fields}, ChatCompletionRequest)
    check_tool_usage(req)
    return req


def answer(req, text, finish="stop"):
    return chat_message(HermesToolParser, None, req, "assistant", text, finish)


def test_auto_with_calls_answers_tool_calls():
    message, finish = answer(request(tools=TOOLS), TWO_CALLS)  # no tool_choice with tools: auto
    assert finish == "tool_calls" and message["content"] == "ok"
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("function", "get_weather", {"city": "Paris"}), ("function", "get_time", {})]
    assert all(c["id"].startswith("chatcmpl-tool-") for c in message["tool_calls"])


def test_auto_without_calls_is_text_and_no_tool_calls_key():
    message, finish = answer(request(tools=TOOLS, tool_choice="auto"), "hello", "length")
    assert message == {"role": "assistant", "content": "hello"} and finish == "length"


def test_named_keeps_its_finish_reason_and_required_says_tool_calls_when_stopped():
    message, finish = answer(request(tools=TOOLS, tool_choice=NAMED), TWO_CALLS)
    assert finish == "stop" and len(message["tool_calls"]) == 2
    message, finish = answer(request(tools=TOOLS, tool_choice="required"), TWO_CALLS)
    assert finish == "tool_calls"
    # NOTE: as vLLM, required says tool_calls on "stop" even when nothing was parsed
    message, finish = answer(request(tools=TOOLS, tool_choice="required"), "no call")
    assert finish == "tool_calls" and message == {"role": "assistant", "content": "no call"}
    message, finish = answer(request(tools=TOOLS, tool_choice="required"), "  ", "length")
    assert finish == "length" and message == {"role": "assistant", "content": ""}


def test_none_is_text_even_with_calls_in_it_and_parallel_false_keeps_the_first():
    message, finish = answer(request(tools=TOOLS, tool_choice="none"), TWO_CALLS)
    assert message["content"] == TWO_CALLS and "tool_calls" not in message and finish == "stop"
    message, _ = answer(request(tools=TOOLS, parallel_tool_calls=False), TWO_CALLS)
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]


def test_without_a_parser_the_text_is_the_answer():
    assert chat_message(None, None, request(), "assistant", TWO_CALLS, "stop") == ({"role": "assistant", "content": TWO_CALLS}, "stop")


def stream(req, text: str, finish: str = "stop") -> tuple[list[dict], str]:
    s = StreamedToolCalls(HermesToolParser, None, req)
    out = []
    for i, ch in enumerate(text):
        d = s.delta(ch, i == len(text) - 1)
        if d is not None:
            out.append(d)
    return out, s.finish_reason(finish)


def test_streamed_calls_end_with_tool_calls_unless_named():
    deltas, finish = stream(request(tools=TOOLS), TWO_CALLS)
    assert finish == "tool_calls" and deltas[0] == {"content": "o"}
    assert [t["function"]["name"] for d in deltas for t in d.get("tool_calls", []) if "name" in t.get("function", {})] == ["get_weather", "get_time"]
    assert stream(request(tools=TOOLS, tool_choice=NAMED), TWO_CALLS)[1] == "stop"
    assert stream(request(tools=TOOLS), TWO_CALLS, "length")[1] == "length"


def test_streamed_parallel_false_sends_only_the_first_call_and_none_sends_text():
    deltas, _ = stream(request(tools=TOOLS, parallel_tool_calls=False), TWO_CALLS)
    assert {t["index"] for d in deltas for t in d.get("tool_calls", [])} == {0}
    deltas, finish = stream(request(tools=TOOLS, tool_choice="none"), TWO_CALLS)
    assert "".join(d["content"] for d in deltas) == TWO_CALLS and finish == "stop"


def refused(**fields) -> APIError:
    with pytest.raises(APIError) as e:
        request(**fields)
    return e.value


def test_request_checks_in_vllms_words():
    # vllm/entrypoints/openai/chat_completion/protocol.py check_tool_usage, answered as a live vllm serve answered
    e = refused(tools=[])
    assert e.message == "`tools` must not be an empty array. Either provide at least one tool or omit the field entirely. (parameter=tools)"
    assert refused(tool_choice="auto").message == "When using `tool_choice`, `tools` must be set. (parameter=tool_choice)"
    e = refused(tools=TOOLS, tool_choice="sometimes")
    assert e.message == 'Invalid value for `tool_choice`: sometimes! Only named tools, "none", "auto" or "required" are supported. (parameter=tool_choice)'
    e = refused(tools=TOOLS, tool_choice={"type": "function"})
    assert e.param == "tool_choice.function" and e.message.startswith("Invalid value for `function`: `None` in `tool_choice`! Correct usage:")
    e = refused(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.message == "The tool specified in `tool_choice` does not match any of the specified `tools` (parameter=tool_choice)"
    e = refused(tools=TOOLS, tool_choice=NAMED, structured_outputs={"regex": "a+"})
    assert e.message == "You can only either use constraints for structured outputs or tools, not both." and e.param is None
    e = refused(tools=[{"type": "x", "function": {"name": "f"}}])
    assert (e.type, e.param) == ("Bad Request", "body.tools.0.type")
    assert e.message == ("1 validation error:\n  {'type': 'literal_error', 'loc': 'body.tools.0.type', 'msg': \"Input should be 'function'\", "
                         "'input': 'x', 'ctx': {'expected': \"'function'\"}}")
    e = refused(tools=[{"type": "function", "function": {"name": 3}}])
    assert e.message == "1 validation error:\n  {'type': 'string_type', 'loc': 'body.tools.0.function.name', 'msg': 'Input should be a valid string', 'input': '3'}"
    e = refused(tools=[{"type": "function"}])
    assert e.message == "1 validation error:\n  {'type': 'missing', 'loc': 'body.tools.0.function', 'msg': 'Field required', 'input': '<dict of 1 items>'}"


def test_without_a_parser_only_none_passes():
    # vllm/renderers/online_renderer.py render_chat
    check_tool_parsing(request(tools=TOOLS, tool_choice="none"), None)
    check_tool_parsing(request(), None)
    for choice, message in [("auto", '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'),
                            ("required", 'tool_choice="required" requires --tool-call-parser to be set'),
                            (NAMED, 'tool_choice=function "get_weather" requires --tool-call-parser to be set')]:
        with pytest.raises(APIError) as e:
            check_tool_parsing(request(tools=TOOLS, tool_choice=choice), None)
        assert e.value.message == message and e.value.status == 400


def test_tools_reach_the_template_as_vllm_dumps_them():
    tools = [{"type": "function", "function": {"name": "f", "strict": True, "extra": 1}, "defer_loading": False}]
    assert template_tools(tools) == [{"type": "function", "function": {"name": "f", "description": None, "parameters": None, "strict": True,
                                                                       "defer_loading": False}, "defer_loading": False}]


def test_forced_calls_get_the_hermes_structural_tag_and_keep_special_tokens():
    req = request(tools=TOOLS, tool_choice="required")
    adjust_request(req, HermesToolParser)
    tag = json.loads(req.structured_outputs.structural_tag)
    assert req.skip_special_tokens is False and tag["format"]["type"] == "tags_with_separator"
    begins = [t["begin"] for t in tag["format"]["tags"]]
    assert begins[:2] == ['<tool_call>\n{"name": "get_weather", "arguments": ', '<tool_call>{"name": "get_weather", "arguments": ']
    assert tag["format"]["at_least_one"] is True and tag["format"]["stop_after_first"] is False
    # a non-strict tool's arguments are any JSON (vLLM's get_function_parameters)
    assert tag["format"]["tags"][0]["content"]["json_schema"] is True
    req = request(tools=TOOLS, tool_choice=NAMED)
    adjust_request(req, HermesToolParser)
    tag = json.loads(req.structured_outputs.structural_tag)
    assert tag["format"]["stop_after_first"] is True and {t["begin"].split('"')[3] for t in tag["format"]["tags"]} == {"get_weather"}
    # auto without a strict tool: no constraint; with a strict one: its schema, behind the trigger
    req = request(tools=TOOLS, tool_choice="auto")
    adjust_request(req, HermesToolParser)
    assert req.structured_outputs is None
    strict = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}]
    req = request(tools=strict, tool_choice="auto")
    adjust_request(req, HermesToolParser)
    tag = json.loads(req.structured_outputs.structural_tag)
    assert tag["format"]["triggers"] == ["<tool_call>"] and tag["format"]["tags"][0]["content"]["json_schema"] == TOOLS[0]["function"]["parameters"]


# --- VLLM_ENFORCE_STRICT_TOOL_CALLING=0: forced calls through a JSON schema -------------


def test_the_forcing_json_schema_as_vllms_get_json_schema_from_tools():
    # vllm/tool_parsers/utils.py get_json_schema_from_tools, by hand
    req = request(tools=TOOLS, tool_choice=NAMED)
    adjust_request(req, HermesToolParser, strict=False)
    assert req.structured_outputs.json == TOOLS[0]["function"]["parameters"] and req.structured_outputs.structural_tag is None
    req = request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    adjust_request(req, HermesToolParser, strict=False)
    assert req.structured_outputs.json == {"type": "object", "properties": {}}  # no parameters: still an object
    req = request(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    adjust_request(req, HermesToolParser, strict=False)
    assert req.structured_outputs.json == {
        "type": "array", "minItems": 1, "maxItems": 1,
        "items": {"type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": ["get_weather"]}, "parameters": TOOLS[0]["function"]["parameters"]},
             "required": ["name", "parameters"]},
            {"properties": {"name": {"type": "string", "enum": ["get_time"]}, "parameters": {"type": "object", "properties": {}}},
             "required": ["name", "parameters"]}]},
    }
    req = request(tools=TOOLS, tool_choice="auto")
    adjust_request(req, HermesToolParser, strict=False)
    assert req.structured_outputs is None


def test_tools_defs_are_gathered_and_a_conflict_is_refused():
    def tool(name, defs):
        return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "$defs": defs}}}

    req = request(tools=[tool("a", {"X": {"type": "string"}}), tool("b", {"X": {"type": "string"}})], tool_choice="required")
    adjust_request(req, HermesToolParser, strict=False)
    assert req.structured_outputs.json["$defs"] == {"X": {"type": "string"}}
    req = request(tools=[tool("a", {"X": {"type": "string"}}), tool("b", {"X": {"type": "integer"}})], tool_choice="required")
    with pytest.raises(APIError) as e:
        adjust_request(req, HermesToolParser, strict=False)
    assert e.value.message == "Tool definition 'X' has multiple schemas, which is not supported. (parameter=tools)"


def test_forced_json_answers():
    # parser/abstract_parser.py DelegatingParser._extract_tool_calls with supports_required_and_named
    message, finish = chat_message(HermesToolParser, None, request(tools=TOOLS, tool_choice=NAMED), "assistant", '{"city": "Rome"}', "stop", True)
    assert finish == "stop" and message["content"] == ""
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [("get_weather", '{"city": "Rome"}')]
    text = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    message, finish = chat_message(HermesToolParser, None, request(tools=TOOLS, tool_choice="required"), "assistant", text, "stop", True)
    assert finish == "tool_calls" and [c["function"]["arguments"] for c in message["tool_calls"]] == ["{}", '{"city": "Oslo"}']
    message, _ = chat_message(HermesToolParser, None, request(tools=TOOLS, tool_choice="required"), "assistant", "[{", "length", True)
    assert message == {"role": "assistant", "content": ""}


def test_forced_json_named_stream_names_the_call_first_then_sends_the_text_as_arguments():
    s = StreamedToolCalls(HermesToolParser, None, request(tools=TOOLS, tool_choice=NAMED), forced_json=True)
    first, second = s.delta('{"ci', False), s.delta('ty": 1}', True)
    assert first["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"ci'} and "content" not in first
    assert second == {"tool_calls": [{"index": 0, "function": {"arguments": 'ty": 1}'}}]}
    assert s.finish_reason("stop") == "stop"


def test_tool_strict_level_and_structured_outputs_beside_tools():
    # vllm/parser/abstract_parser.py _apply_structural_tag, tool_parsers/structural_tag_registry.py resolve_tool_strictness
    req = request(tools=TOOLS, tool_choice="auto")
    adjust_request(req, HermesToolParser, strict_level="function")  # the envelope, arguments free
    tag = json.loads(req.structured_outputs.structural_tag)
    assert tag["format"]["type"] == "triggered_tags" and tag["format"]["tags"][0]["content"]["json_schema"] is True
    req = request(tools=TOOLS, tool_choice="auto")
    adjust_request(req, HermesToolParser, strict_level="parameter")  # every tool as if strict
    tag = json.loads(req.structured_outputs.structural_tag)
    assert tag["format"]["tags"][0]["content"]["json_schema"] == TOOLS[0]["function"]["parameters"]
    req = request(tools=TOOLS, tool_choice="auto", parallel_tool_calls=False)
    adjust_request(req, HermesToolParser)
    assert json.loads(req.structured_outputs.structural_tag)["format"]["stop_after_first"] is True
    # the forced call replaces the request's own constraint
    req = request(tools=TOOLS, tool_choice="required", structured_outputs={"regex": "a+"})
    adjust_request(req, HermesToolParser)
    assert req.structured_outputs.regex is None and req.structured_outputs.structural_tag is not None
    # auto with structured outputs and no strict tool: the request's constraint alone
    req = request(tools=TOOLS, tool_choice="auto", structured_outputs={"regex": "a+"})
    adjust_request(req, HermesToolParser)
    assert req.structured_outputs.regex == "a+"


def test_what_enable_log_outputs_logs_of_calls():
    # vllm/entrypoints/openai/chat_completion/serving.py: "[tool_calls: name(arguments)]" when there is no content
    from frontend.tools.calls import logged_delta, logged_output

    message, _ = answer(request(tools=TOOLS), '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>')
    assert logged_output(message) == '[tool_calls: get_time({"tz": "UTC"})]'
    assert logged_output({"role": "assistant", "content": "hi", "tool_calls": message["tool_calls"]}) == "hi"
    assert logged_delta({"content": None, "tool_calls": [{"index": 0, "function": {"arguments": '{"a'}}]}) == '[tool_calls: {"a]'
    assert logged_delta({"content": "x"}) == "x" and logged_delta({}) == ""


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_the_forcing_tag_accepts_a_call_in_hermes_format_and_nothing_else(choice):
    # the tag compiled by xgrammar (as structured outputs will): a call to a listed tool passes, text or another name not
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    req = request(tools=TOOLS, tool_choice=choice)
    adjust_request(req, HermesToolParser)
    grammar = xgr.Grammar.from_structural_tag(req.structured_outputs.structural_tag)
    assert _is_grammar_accept_string(grammar, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    assert not _is_grammar_accept_string(grammar, "Sure, the weather is fine.")
    assert not _is_grammar_accept_string(grammar, '<tool_call>\n{"name": "get_forecast", "arguments": {}}\n</tool_call>')
    two = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call><tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    assert _is_grammar_accept_string(grammar, two) == (choice == "required")  # a named call stops after one


def test_the_order_of_vllms_checks():
    # vLLM's validators first (tool_choice, then structured outputs), pydantic's types after, as vLLM's
    # ChatCompletionRequest answered them in .venv-vllm
    e = refused(tools=[{"type": "x", "function": {"name": "f"}}], tool_choice="sometimes")
    assert e.message.startswith("Invalid value for `tool_choice`: sometimes!")
    e = refused(tools=TOOLS, tool_choice=NAMED, structured_outputs={"regex": "a", "json": {}})
    assert e.message == "You can only use one kind of constraints for structured outputs ('json', 'regex' or 'choice')."
    e = refused(tools=TOOLS, tool_choice={"type": "other", "function": {"name": "get_weather"}})
    assert e.param == "body.tool_choice" and e.type == "Bad Request"
    # recorded from a live vllm serve 0.32
    assert e.message == ("4 validation errors:\n"
                         "  {'type': 'literal_error', 'loc': 'body.tool_choice', 'msg': \"Input should be 'none'\", 'input': '<dict of 2 items>', 'ctx': {'expected': \"'none'\"}}\n"
                         "  {'type': 'literal_error', 'loc': 'body.tool_choice', 'msg': \"Input should be 'auto'\", 'input': '<dict of 2 items>', 'ctx': {'expected': \"'auto'\"}}\n"
                         "  {'type': 'literal_error', 'loc': 'body.tool_choice', 'msg': \"Input should be 'required'\", 'input': '<dict of 2 items>', 'ctx': {'expected': \"'required'\"}}\n"
                         "  {'type': 'literal_error', 'loc': 'body.tool_choice.type', 'msg': \"Input should be 'function'\", 'input': 'other', 'ctx': {'expected': \"'function'\"}}")


def test_auto_with_a_tag_and_structured_outputs_is_a_call_or_the_constrained_answer():
    # vllm/parser/abstract_parser.py _apply_structural_tag: OrFormat of the "required" tag and the output's format
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    strict = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}]
    req = request(tools=strict, tool_choice="auto", structured_outputs={"regex": "a+"})
    adjust_request(req, HermesToolParser)
    tag = json.loads(req.structured_outputs.structural_tag)
    assert req.structured_outputs.regex is None and tag["format"]["type"] == "or"
    assert [e["type"] for e in tag["format"]["elements"]] == ["tags_with_separator", "regex"]
    grammar = xgr.Grammar.from_structural_tag(req.structured_outputs.structural_tag)
    assert _is_grammar_accept_string(grammar, "aaa")
    assert _is_grammar_accept_string(grammar, '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')
    assert not _is_grammar_accept_string(grammar, "hello")
    # a constraint xgrammar refuses is not joined: it stays the request's own, the calls free
    req = request(tools=strict, tool_choice="auto", structured_outputs={"regex": "("})
    adjust_request(req, HermesToolParser)
    assert req.structured_outputs.regex == "(" and req.structured_outputs.structural_tag is None


def test_the_joined_constraint_is_read_as_vllms_extract_structured_outputs():
    # response_format over structured_outputs (vllm/entrypoints/generate/base/protocol.py structured_outputs_from_response_format)
    from types import SimpleNamespace

    from frontend.schema.requests import StructuredOutputsParams
    from frontend.tools.output_format import output_format

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = SimpleNamespace(structured_outputs=StructuredOutputsParams(regex="x"),
                          response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
    assert output_format(req).model_dump()["json_schema"] == schema  # json wins over regex, as structured_outputs_to_format
    req = SimpleNamespace(structured_outputs=None, response_format={"type": "json_object"})
    assert output_format(req).model_dump()["json_schema"] == {"type": "object"}
    req = SimpleNamespace(structured_outputs=StructuredOutputsParams(choice=["yes", "no"]), response_format={"type": "text"})
    assert [e["value"] for e in output_format(req).model_dump()["elements"]] == ["yes", "no"]
    req = SimpleNamespace(structured_outputs=StructuredOutputsParams(grammar='start: "a"'), response_format=None)
    assert output_format(req).model_dump()["type"] == "grammar"  # Lark, converted to EBNF
