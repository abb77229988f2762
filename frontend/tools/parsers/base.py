"""What every tool-call parser shares (vLLM's ``ToolParser`` and ``tool_parsers/utils``):
the parsed call, the streamed delta, the per-stream state, and the text helpers.

A parser is built once per choice of a request (it holds its stream's state) and is
asked either ``extract_tool_calls(text)`` for a whole answer or, token by token,
``extract_tool_calls_streaming(previous_text, current_text, delta_text)``.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from json import JSONDecodeError, JSONDecoder
from typing import Any

import partial_json_parser
from partial_json_parser.core.options import Allow


def make_tool_call_id() -> str:
    """vLLM's ``make_tool_call_id`` (id type "random"): 16 hex digits of a uuid4."""
    return f"chatcmpl-tool-{uuid.uuid4().int & (2**64 - 1):016x}"


@dataclass(slots=True)
class ToolCall:
    """One parsed call, as the answer's ``message.tool_calls[i]``."""

    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=make_tool_call_id)

    def to_json(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(slots=True)
class ExtractedToolCalls:
    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None


@dataclass(slots=True)
class DeltaToolCall:
    """vLLM's ``DeltaToolCall`` with its fields as set: a call's first delta has id,
    type and function name; the others only argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None
    null_name: bool = False  # "name": null sent (vLLM's forced "required" stream)

    def to_json(self) -> dict:
        out: dict[str, Any] = {}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
        out["index"] = self.index
        fn = {k: v for k, v in (("name", self.name), ("arguments", self.arguments)) if v is not None or k == "name" and self.null_name}
        if fn:
            out["function"] = fn
        return out


@dataclass(slots=True)
class DeltaMessage:
    """What one streamed step adds: new content and/or tool-call deltas. ``content``
    is sent even when None where vLLM's parser set it so (``content_set``)."""

    content: str | None = None
    tool_calls: list[DeltaToolCall] = field(default_factory=list)
    content_set: bool = True

    def to_json(self) -> dict:
        out: dict[str, Any] = {}
        if self.content_set:
            out["content"] = self.content
        if self.tool_calls:
            out["tool_calls"] = [t.to_json() for t in self.tool_calls]
        return out


class ToolParser:
    """vLLM's ``ToolParser``: the stream state every parser keeps."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.prev_tool_call_arr: list[dict] = []
        self.current_tool_id = -1  # the call being parsed
        self.current_tool_name_sent = False
        self.streamed_args_for_tool: list[str] = []  # argument text sent, per call

    # NOTE: in vLLM 0.32 these two parsers have a structural-tag model, so with its
    # default VLLM_ENFORCE_STRICT_TOOL_CALLING they parse "required" and named calls
    # from their own format, as "auto" (``supports_required_and_named`` is False).
    structural_tag_model: str | None = None
    # Whether a request with tools (tool_choice not "none") keeps special tokens.
    keeps_special_tokens = False

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        raise NotImplementedError

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str, delta_text: str) -> DeltaMessage | None:
        raise NotImplementedError

    def get_remaining_unstreamed_args(self) -> str:
        """Argument text parsed but not yet streamed, of the last call (sent on the
        stream's last delta)."""
        if not self.prev_tool_call_arr:
            return ""
        index = len(self.prev_tool_call_arr) - 1
        args = self.prev_tool_call_arr[index].get("arguments", {})
        expected = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        actual = self.streamed_args_for_tool[index] if index < len(self.streamed_args_for_tool) else ""
        return expected[len(actual):] if expected.startswith(actual) else ""


def partial_tag_overlap(text: str, tag: str) -> int:
    """The length of the longest prefix of ``tag`` that ends ``text`` (a tag that may
    still be arriving)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def find_common_prefix(s1: str, s2: str) -> str:
    n = 0
    for a, b in zip(s1, s2, strict=False):
        if a != b:
            break
        n += 1
    return s1[:n]


def is_complete_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except JSONDecodeError:
        return False


def partial_json_loads(text: str, flags: Allow) -> tuple[Any, int]:
    """``(value, characters read)`` of a JSON text that may be cut short or followed by
    more text (partial_json_parser reads the first, JSONDecoder.raw_decode the second)."""
    try:
        return partial_json_parser.loads(text, flags), len(text)
    except JSONDecodeError as e:
        if "Extra data" in e.msg:
            return JSONDecoder().raw_decode(text)
        raise
