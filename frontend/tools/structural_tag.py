"""The xgrammar structural tag vLLM 0.32 constrains tool calls with (its
``_apply_structural_tag`` and ``structural_tag_registry``): the parser's call format
(hermes: ``<tool_call>{"name": "f", "arguments": ...}</tool_call>``; llama: xgrammar's
builtin), each allowed function's name fixed and, for a strict tool, its arguments
held to the tool's parameters schema.

When: "required" and a named function always; "auto" only when a tool is
``strict``, ``parallel_tool_calls`` is false or --tool-strict-level is function or
parameter (else the model writes freely and the parser reads what it wrote).
``parallel_tool_calls: false`` stops after one call. "auto" beside the request's own
structured outputs is a call or the constrained answer (frontend.tools.output_format).
"""

from __future__ import annotations

from typing import Any

# NOTE: xgrammar (which loads torch) is imported inside the functions: only a
# request with tools on a server that parses them builds a tag.
from frontend.tools.choice import requested_constraint, template_tools
from frontend.tools.output_format import output_format

# vLLM's ToolStrictLevel (--tool-strict-level, of which kvpool accepts only auto).
AUTO, FUNCTION, PARAMETER = 0, 1, 2
LEVELS = {"auto": AUTO, "function": FUNCTION, "parameter": PARAMETER}


def structural_tag(model: str | None, req, level: str = "auto") -> dict | None:
    """The tag as a JSON-able dict (vLLM's ``structural_tag.model_dump()``), or None
    when the request's calls are not constrained; ``level``: --tool-strict-level."""
    choice = req.tool_choice
    if model is None or not req.tools or choice not in ("auto", "required") and not isinstance(choice, dict):
        return None
    is_auto = choice == "auto"
    single_call = req.parallel_tool_calls is False
    structured = requested_constraint(req)
    strict_level = LEVELS[level]
    if single_call and not (is_auto and structured):
        strict_level = max(strict_level, FUNCTION)  # NOTE: limiting the calls needs their envelope in the grammar
    if _resolve_strictness(template_tools(req.tools), choice, strict_level) is None:
        return None
    output = None
    if is_auto and structured:
        # NOTE: as vLLM: a call or the request's own constraint, one grammar; the call
        # part is then "required"'s (auto's would let any text through).
        if (output := output_format(req)) is None:
            return None
        choice = "required"
    from xgrammar import StructuralTag, get_model_structural_tag, normalize_tool_choice
    from xgrammar.structural_tag import OrFormat

    tools = [_xgrammar_tool(t) for t in _resolve_strictness(template_tools(req.tools), choice, strict_level)]
    tool_choice = {"type": "function", "function": {"name": choice["function"]["name"]}} if isinstance(choice, dict) else choice
    if model == "hermes":
        function_tools, _, simplified = normalize_tool_choice(tools, tool_choice)
        tag = _hermes(function_tools, simplified)
    else:
        tag = get_model_structural_tag(model=model, tools=tools, tool_choice=tool_choice, reasoning=False)
    if single_call:
        _limit_to_single_tool_call(tag)
    if output is not None:
        tag = StructuralTag(format=OrFormat(elements=[tag.format, output]))
    return tag.model_dump()


def _resolve_strictness(tools: list[dict], choice: Any, strict_level: int) -> list[dict] | None:
    """vLLM's ``resolve_tool_strictness``: None (no tag) for "auto" with no strict tool
    at the auto level; else each tool with ``strict`` pinned."""
    def strict(tool: dict) -> bool:
        return tool["function"].get("strict") is True

    if choice == "auto" and strict_level == AUTO and not any(strict(t) for t in tools):
        return None
    return [{**t, "function": {**t["function"], "strict": strict_level >= PARAMETER or strict(t)}} for t in tools]


def _xgrammar_tool(tool: dict) -> dict:
    """A tool as xgrammar reads it: the function's unset fields left out."""
    return {"type": "function", "function": {k: v for k, v in tool["function"].items() if v is not None}}


def _hermes(tools, tool_choice: str):
    """vLLM's hermes tag: each call as ``<tool_call>`` + ``{"name": "NAME", "arguments": ``
    + the arguments + ``}</tool_call>``, with or without new lines around the object."""
    from xgrammar import StructuralTag
    from xgrammar.structural_tag import (
        AnyTextFormat,
        JSONSchemaFormat,
        TagFormat,
        TagsWithSeparatorFormat,
        TriggeredTagsFormat,
    )

    def parameters(function) -> dict | bool:
        if function.strict is False:
            return True  # NOTE: a non-strict tool's arguments are any JSON value
        return function.parameters if function.parameters is not None else True

    envelopes = [('<tool_call>\n{"name": "', "}\n</tool_call>"), ('<tool_call>{"name": "', "}</tool_call>")]
    tags = [TagFormat(begin=begin + t.function.name + '", "arguments": ', content=JSONSchemaFormat(json_schema=parameters(t.function)), end=end)
            for t in tools for begin, end in envelopes]
    if tool_choice == "auto":
        return StructuralTag(format=TriggeredTagsFormat(triggers=["<tool_call>"], tags=tags) if tags else AnyTextFormat())
    return StructuralTag(format=TagsWithSeparatorFormat(tags=tags, separator="", at_least_one=True, stop_after_first=tool_choice == "forced"))


def _limit_to_single_tool_call(tag) -> None:
    """Every list of calls in the tag stops after its first (vLLM's ``limit_to_single_tool_call``)."""
    from pydantic import BaseModel
    from xgrammar.structural_tag import (
        TagsWithSeparatorFormat,
        TokenTriggeredTagsFormat,
        TriggeredTagsFormat,
    )

    def visit(node) -> None:
        if isinstance(node, BaseModel):
            if isinstance(node, TriggeredTagsFormat | TokenTriggeredTagsFormat | TagsWithSeparatorFormat):
                node.stop_after_first = True
            for name in type(node).model_fields:
                visit(getattr(node, name))
        elif isinstance(node, list | tuple):
            for item in node:
                visit(item)

    visit(tag.format)
