"""vLLM's tool-call parsers (``--tool-call-parser NAME``), by vLLM's names: the ones
kvpool has, each in its own file."""

from __future__ import annotations

from frontend.tools.parsers.base import ToolParser
from frontend.tools.parsers.hermes import HermesToolParser
from frontend.tools.parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "llama4_json": Llama3JsonToolParser,
}


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class of ``name``; a KeyError names the ones there are."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise KeyError(f"Tool parser '{name}' not found.") from None


def configured_tool_parser(name: str | None, enable_auto_tool_choice: bool, tokenizer, model: str) -> type[ToolParser] | None:
    """vLLM's ``ParserManager.get_parser`` for tools: a parser only with both flags
    (``--tool-call-parser`` alone parses nothing), checked once against the tokenizer
    so that a parser the checkpoint cannot use fails at start-up, in vLLM's words."""
    if not enable_auto_tool_choice or name is None:
        return None
    parser_cls = get_tool_parser(name)
    try:
        parser_cls(tokenizer)
    except Exception as e:
        raise TypeError(f"--tool-call-parser {name} cannot be used with the tokenizer of {model!r}: {e}") from e
    return parser_cls
