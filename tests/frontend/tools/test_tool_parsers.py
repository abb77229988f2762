"""The hermes and llama3_json tool-call parsers on texts a model writes. Expected
values are read off vLLM 0.32's parsers (vllm/tool_parsers/hermes_tool_parser.py,
llama_tool_parser.py) by hand; test_tool_parsers_compare.py runs vLLM's own classes."""

from __future__ import annotations

import json

import pytest

from frontend.tools.parsers import configured_tool_parser, get_tool_parser
from frontend.tools.parsers.hermes import HermesToolParser
from frontend.tools.parsers.llama3_json import Llama3JsonToolParser


class Vocab:
    """A tokenizer as the parsers use it: only its vocabulary."""

    def __init__(self, *tokens: str):
        self.tokens = tokens

    def get_vocab(self) -> dict[str, int]:
        return {t: i for i, t in enumerate(self.tokens)}


LLAMA_TOK = Vocab("<|python_tag|>")


def calls(info) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in info.tool_calls]


def stream(parser, text: str, step: int) -> list[dict]:
    out, prev = [], ""
    for i in range(0, len(text), step):
        delta = text[i : i + step]
        m = parser.extract_tool_calls_streaming(prev, prev + delta, delta)
        prev += delta
        if m is not None:
            out.append(m.to_json())
    return out


def joined(deltas: list[dict]) -> tuple[str, dict[int, str], dict[int, str]]:
    """(content, name per call, arguments per call) of a delta sequence."""
    content, names, args = "", {}, {}
    for d in deltas:
        content += d.get("content") or ""
        for t in d.get("tool_calls", []):
            fn = t.get("function", {})
            if "name" in fn:
                assert t["id"].startswith("chatcmpl-tool-") and t["type"] == "function" and t["index"] not in names
                names[t["index"]] = fn["name"]
            args[t["index"]] = args.get(t["index"], "") + fn.get("arguments", "")
    return content, names, args


HERMES_TWO = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>\n'
              '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def test_hermes_reads_every_call_and_the_text_before_them():
    info = HermesToolParser(None).extract_tool_calls(HERMES_TWO)
    assert info.tools_called and info.content == "Let me check."
    assert calls(info) == [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {})]
    assert len({c.id for c in info.tool_calls}) == 2 and all(c.id.startswith("chatcmpl-tool-") for c in info.tool_calls)


def test_hermes_without_a_call_is_content_and_a_call_first_leaves_none():
    assert HermesToolParser(None).extract_tool_calls("just text").content == "just text"
    info = HermesToolParser(None).extract_tool_calls('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>')
    assert info.content is None and calls(info) == [("f", {"a": 1})]


def test_hermes_reads_a_last_call_cut_after_its_json():
    info = HermesToolParser(None).extract_tool_calls('<tool_call>{"name": "f", "arguments": {"a": "é"}}')
    assert calls(info) == [("f", {"a": "é"})] and info.tool_calls[0].arguments == '{"a": "é"}'  # ensure_ascii=False


@pytest.mark.parametrize("text", ['<tool_call>{"name": "f", "arguments": {"a": </tool_call>', '<tool_call>{"name": "f"}</tool_call>'])
def test_hermes_malformed_call_makes_the_whole_output_content(text):
    info = HermesToolParser(None).extract_tool_calls(text)
    assert not info.tools_called and info.tool_calls == [] and info.content == text


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_hermes_stream_sends_content_then_each_name_once_then_its_arguments(step):
    deltas = stream(HermesToolParser(None), HERMES_TWO, step)
    content, names, args = joined(deltas)
    assert content == "Let me check." and names == {0: "get_weather", 1: "get_time"}
    assert args == {0: '{"city": "Paris", "unit": "c"}', 1: "{}"}
    # a call's deltas carry "content": null beside them, as vLLM's DeltaMessage(content=None, ...)
    assert all("content" in d for d in deltas)


def test_hermes_stream_holds_back_what_may_start_a_tag():
    p = HermesToolParser(None)
    assert p.extract_tool_calls_streaming("", "Hi <tool", "Hi <tool").to_json() == {"content": "Hi "}
    assert p.extract_tool_calls_streaming("Hi <tool", "Hi <tool_ca", "_ca") is None


def test_llama3_json_reads_calls_separated_by_semicolons_and_parameters_as_arguments():
    text = '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {"y": [1, {"z": null}]}}'
    info = Llama3JsonToolParser(LLAMA_TOK).extract_tool_calls(text)
    assert info.tools_called and info.content is None
    assert calls(info) == [("a", {"x": 1}), ("b", {"y": [1, {"z": None}]})]


def test_llama3_json_drops_text_around_calls_and_refuses_a_bad_object():
    info = Llama3JsonToolParser(LLAMA_TOK).extract_tool_calls('Sure: {"name": "a", "arguments": {}} done')
    assert calls(info) == [("a", {})] and info.content is None
    for text in ('{"arguments": {}}', "use {x} here", "plain"):
        info = Llama3JsonToolParser(LLAMA_TOK).extract_tool_calls(text)
        assert not info.tools_called and info.content == text


@pytest.mark.parametrize("step", [1, 3, 7])
def test_llama3_json_stream_sends_name_then_arguments_of_each_call(step):
    text = '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "f", "arguments": {"a": [1, 2]}}'
    p = Llama3JsonToolParser(LLAMA_TOK)
    deltas = stream(p, text, step)
    content, names, args = joined(deltas)
    assert content == "" and names == {0: "get_weather", 1: "f"}
    # NOTE: vLLM re-serialises the arguments (json.dumps); the last call's tail is sent
    # at the stream's end (get_remaining_unstreamed_args)
    assert args[0] == '{"city": "Paris"}'
    assert args[1] + p.get_remaining_unstreamed_args() == '{"a": [1, 2]}'
    assert all("content" not in d for d in deltas)


def test_llama3_json_stream_of_plain_text_is_content():
    p = Llama3JsonToolParser(LLAMA_TOK)
    assert p.extract_tool_calls_streaming("", "Hello", "Hello").to_json() == {"content": "Hello"}


def test_registry_and_the_tokenizer_check_at_start_up():
    assert get_tool_parser("hermes") is HermesToolParser and get_tool_parser("llama4_json") is Llama3JsonToolParser
    with pytest.raises(KeyError, match="Tool parser 'mistral' not found."):
        get_tool_parser("mistral")
    # --tool-call-parser alone parses nothing (vLLM's ParserManager.get_tool_parser)
    assert configured_tool_parser("hermes", False, Vocab(), "m") is None
    assert configured_tool_parser("hermes", True, Vocab(), "m") is HermesToolParser
    # vllm/parser/parser_manager.py validate_parser_tokenizer, with the parser's own words
    with pytest.raises(TypeError) as e:
        configured_tool_parser("llama3_json", True, Vocab("<|eos|>"), "/m")
    assert str(e.value) == ("--tool-call-parser llama3_json cannot be used with the tokenizer of '/m': "
                            "Llama3JsonToolParser could not locate the bot token '<|python_tag|>' in the tokenizer.")


def test_the_tiny_checkpoint_serves_hermes_but_not_llama3_json(tiny_checkpoint):
    # Its tokenizer has no <|python_tag|>: vLLM refuses llama3_json at start-up with it too.
    from frontend.text.tokenizer import Tokenizer

    tok = Tokenizer(tiny_checkpoint)
    assert configured_tool_parser("hermes", True, tok, "m") is HermesToolParser
    with pytest.raises(TypeError, match="could not locate the bot token '<|python_tag|>'"):
        configured_tool_parser("llama3_json", True, tok, "m")
    vocab = tok.get_vocab()
    assert vocab["<|eos|>"] == tok.eos_token_id and len(vocab) == tok.vocab_size
