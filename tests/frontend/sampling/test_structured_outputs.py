"""The request side of structured outputs: vLLM 0.32's conversion of
``structured_outputs`` / ``response_format`` into the one spec xgrammar compiles, and
its refusals. Expected values are vLLM's: its source (``choice_as_grammar``,
``grammar_is_likely_lark``, ``get_structured_output_key``) and its recorded answers to
the same requests (a live ``vllm serve`` of the tiny checkpoint, xgrammar-valid specs)."""

from __future__ import annotations

import json
import re

import msgspec
import pytest

from frontend.sampling.structured_outputs import (
    choice_as_grammar,
    grammar_is_likely_lark,
    grammar_spec_of,
)
from frontend.schema.errors import APIError
from frontend.schema.requests import ChatCompletionRequest, CompletionRequest
from protocol.structured_output import GrammarSpec

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def completion(**fields) -> CompletionRequest:
    return msgspec.convert({"prompt": "x", **fields}, CompletionRequest)


def chat(**fields) -> ChatCompletionRequest:
    return msgspec.convert({"messages": [{"role": "user", "content": "x"}], **fields}, ChatCompletionRequest)


def refusal(req) -> APIError:
    with pytest.raises(APIError) as e:
        grammar_spec_of(req)
    assert e.value.status == 400
    return e.value


def test_no_constraint_is_no_grammar():
    assert grammar_spec_of(completion()) is None
    assert grammar_spec_of(completion(response_format={"type": "text"})) is None


@pytest.mark.parametrize(
    ("so", "expected"),
    [
        ({"regex": "[a-z]+"}, GrammarSpec("regex", "[a-z]+")),
        # vLLM's choice_as_grammar: one quoted alternative each.
        ({"choice": ["yes", "no"]}, GrammarSpec("ebnf", 'root ::= "yes" | "no"')),
        # An object schema travels as json.dumps of it (vLLM's structured_output_key).
        ({"json": SCHEMA}, GrammarSpec("json", json.dumps(SCHEMA))),
        ({"json": '{"type": "string"}'}, GrammarSpec("json", '{"type": "string"}')),
        ({"json_object": True}, GrammarSpec("json_object", "")),
        ({"grammar": 'root ::= "a"'}, GrammarSpec("ebnf", 'root ::= "a"')),
        ({"grammar": 'start: "a" | "b"'}, GrammarSpec("lark", 'start: "a" | "b"')),
    ],
)
def test_structured_outputs_kinds(so, expected):
    assert grammar_spec_of(completion(structured_outputs=so)) == expected
    assert grammar_spec_of(chat(structured_outputs=so)) == expected


def test_response_format_overrides_structured_outputs():
    # vLLM's structured_outputs_from_response_format: the response format's constraint
    # replaces the request's (a json_schema's "schema"; json_object).
    req = chat(structured_outputs={"regex": "a"}, response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}})
    with pytest.raises(APIError):  # regex and json both set now: vLLM refuses that too
        grammar_spec_of(req)
    req = chat(response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}})
    assert grammar_spec_of(req) == GrammarSpec("json", json.dumps(SCHEMA))
    assert grammar_spec_of(completion(response_format={"type": "json_object"})) == GrammarSpec("json_object", "")
    assert grammar_spec_of(completion(structured_outputs={"choice": ["a"]}, response_format={"type": "text"})) == GrammarSpec(
        "ebnf", 'root ::= "a"'
    )


def test_choice_escapes_as_vllm():
    assert choice_as_grammar(['say "hi"', "a\\b", "x\ny", "t\tz", "\x01"]) == (
        r'root ::= "say \"hi\"" | "a\\b" | "x\ny" | "t\tz" | "\u0001"'
    )


def test_grammar_is_likely_lark_as_vllm():
    assert grammar_is_likely_lark("rule: 'abc'")
    assert not grammar_is_likely_lark("rule ::= 'abc'")
    assert not grammar_is_likely_lark("# comment\nroot ::= 'a'  // trailing")
    assert not grammar_is_likely_lark("")


# The message and param vLLM 0.32 answered each of these with (recorded live).
REFUSALS = [
    ({"choice": []}, "Choice '[]' cannot be an empty list", None),
    ({"json": "{bad"}, "Invalid JSON grammar specification.", None),
    ({"json_object": False}, "structured_outputs.json_object must be True if set; omit structured_outputs to disable structured outputs", None),
    ({"grammar": "  "}, "structured_outputs.grammar cannot be an empty string", None),
    ({"json": " "}, "structured_outputs.json cannot be an empty string", None),
    ({"regex": "a\x00"}, "structured_outputs.regex must not contain a NUL character ('\\x00')", None),
    ({"regex": "a", "choice": ["b"]},
     "You can only use one kind of constraints for structured outputs ('json', 'regex' or 'choice'). (parameter=structured_outputs)",
     "structured_outputs"),
]


@pytest.mark.parametrize(("so", "message", "param"), REFUSALS)
def test_refusals_in_vllms_words(so, message, param):
    e = refusal(completion(structured_outputs=so))
    assert (e.message, e.param) == (message, param)


def test_refusals_of_several_or_no_constraint():
    e = refusal(completion(structured_outputs={"regex": "a", "grammar": 'root ::= "a"'}))
    assert e.message.startswith("You can only use one kind of structured outputs constraint but multiple are specified: {'json': None, 'regex': 'a',")
    assert e.message.endswith("'structural_tag': None, '_backend': None, '_backend_was_auto': False}")
    e = refusal(completion(structured_outputs={}))
    assert e.message.startswith("You must use one kind of structured outputs constraint but none are specified: ")
    # a json_schema response format without its "schema" becomes json=None: none at all
    e = refusal(completion(response_format={"type": "json_schema", "json_schema": {"name": "x"}}))
    assert e.message.startswith("You must use one kind of structured outputs constraint but none are specified: ")
    # the chat request's own check names no parameter (vLLM's chat model validator)
    e = refusal(chat(structured_outputs={"regex": "a", "choice": ["b"]}))
    assert (e.message, e.param) == ("You can only use one kind of constraints for structured outputs ('json', 'regex' or 'choice').", None)


def test_response_format_json_schema_needs_its_schema_field():
    for req in (completion(response_format={"type": "json_schema"}), chat(response_format={"type": "json_schema"})):
        e = refusal(req)
        assert e.message == "When response_format type is 'json_schema', the 'json_schema' field must be provided. (parameter=response_format)"
        assert e.param == "response_format"


def test_specs_xgrammar_cannot_parse_are_400():
    # vLLM (backend xgrammar, recorded): "Failed to transform regex into a grammar: [05:11:47] <path>:83: Regex
    # parsing error at position 3: The parenthesis is not closed." -- its xgrammar (0.2.8) has the line at 83.
    message = refusal(completion(structured_outputs={"regex": "(a"})).message
    assert re.fullmatch(r"Failed to transform regex into a grammar: \[\d\d:\d\d:\d\d\] <path>:\d+: Regex parsing error at "
                        r"position 3: The parenthesis is not closed\.", message)
    assert refusal(completion(structured_outputs={"grammar": 'root ::= ("a"'})).message == "Invalid grammar specification."
    schema = {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}
    assert refusal(completion(structured_outputs={"json": schema})).message.startswith("Failed to transform json schema into a grammar: ")
    # vLLM's list of keywords xgrammar would silently not enforce
    e = refusal(completion(structured_outputs={"json": {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 3}}}}))
    assert e.message == "The provided JSON schema contains features not supported by xgrammar."


def test_too_deep_a_schema_is_refused():
    schema: dict = {"type": "string"}
    for _ in range(70):
        schema = {"type": "array", "items": schema}
    assert refusal(completion(structured_outputs={"json": schema})).message == (
        "The JSON schema is nested too deeply: objects and arrays may nest at most 64 levels"
    )


# A structural tag in xgrammar's current form, and the same in its deprecated one (vLLM
# compiles both): a <n>...</n> block holding {"n": integer}, triggered by "<n>".
_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
TAG = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<n>"], "tags": [
    {"begin": "<n>", "content": {"type": "json_schema", "json_schema": _SCHEMA}, "end": "</n>"}]}}
LEGACY_TAG = {"structures": [{"begin": "<n>", "schema": _SCHEMA, "end": "</n>"}], "triggers": ["<n>"]}


@pytest.mark.parametrize("tag", [TAG, LEGACY_TAG], ids=["format", "structures"])
def test_a_structural_tag_is_parsed_and_travels_as_given(tag):
    spec = grammar_spec_of(completion(structured_outputs={"structural_tag": json.dumps(tag)}))
    assert spec == GrammarSpec("structural_tag", json.dumps(tag))


def test_a_bad_structural_tag_is_vllms_400_and_its_response_format_is_refused_by_name():
    # vLLM's words (its validate_xgrammar_grammar), a 400 without a param.
    assert refusal(completion(structured_outputs={"structural_tag": "{}"})).message == "Invalid structural tag specification."
    e = refusal(completion(response_format={"type": "structural_tag", "format": {}}))
    assert e.param == "response_format" and "structural_tag" in e.message


def test_regex_compilation_has_vllms_timeout(monkeypatch):
    import time

    from frontend.sampling.structured_outputs import compile_regex_with_timeout

    monkeypatch.setenv("VLLM_REGEX_COMPILATION_TIMEOUT_S", "1")
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"^Regex compilation timed out after 1s\. .* Pattern: a\+$"):
        compile_regex_with_timeout(lambda p: time.sleep(5), "a+")
    assert time.monotonic() - start < 3
    assert compile_regex_with_timeout(str.upper, "ok") == "OK"
    monkeypatch.setenv("VLLM_REGEX_COMPILATION_TIMEOUT_S", "0")  # none
    assert compile_regex_with_timeout(str.upper, "ok") == "OK"
