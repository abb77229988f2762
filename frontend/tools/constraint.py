"""The parser's ``adjust_request`` (vLLM's ``DelegatingParser``): "required" and named tool
calls forced through an xgrammar structural tag in the parser's own call format
(frontend/tools/structural_tag.py; vLLM's default VLLM_ENFORCE_STRICT_TOOL_CALLING), else a
JSON schema of the calls (frontend/tools/json_schema.py). Apart from frontend/tools/choice.py,
whose helpers both of those read, so that no module imports its importer."""

from __future__ import annotations

import json

from frontend.schema.requests import ChatCompletionRequest, StructuredOutputsParams
from frontend.tools.json_schema import json_schema_from_tools
from frontend.tools.parsers.base import ToolParser
from frontend.tools.structural_tag import structural_tag


def _force(req, constraint: StructuredOutputsParams) -> None:
    """The calls' constraint replaces the request's own, as vLLM's (response_format dropped)."""
    req.structured_outputs = constraint
    if getattr(req, "response_format", None) is not None:
        req.response_format = None


def adjust_request(req: ChatCompletionRequest, parser_cls: type[ToolParser] | None, strict: bool = True,
                   strict_level: str = "auto") -> None:
    """vLLM's ``DelegatingParser.adjust_request`` for a tool parser: the structural tag
    that constrains the calls (``strict``: VLLM_ENFORCE_STRICT_TOOL_CALLING, vLLM's
    default), else a JSON schema for "required" and named calls; and the parser's own
    needs (special tokens kept)."""
    if parser_cls is None or not req.tools:
        return
    if strict:
        if (tag := structural_tag(parser_cls.structural_tag_model, req, strict_level)) is not None:
            _force(req, StructuredOutputsParams(structural_tag=json.dumps(tag)))
    elif req.structured_outputs is None or req.structured_outputs.structural_tag is None:
        if (schema := json_schema_from_tools(req.tool_choice, req.tools, req.parallel_tool_calls)) is not None:
            _force(req, StructuredOutputsParams(json=schema))
    if parser_cls.keeps_special_tokens and req.tool_choice != "none":
        req.skip_special_tokens = False
