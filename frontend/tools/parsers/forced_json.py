"""Forced calls read from the JSON the schema of frontend.tools.json_schema made the model
write (vLLM 0.32 with VLLM_ENFORCE_STRICT_TOOL_CALLING=0: ``DelegatingParser``'s
"required"/named branches and ``tool_parsers/streaming.py``): a named call's whole
text is its arguments; "required" is an array of ``{"name", "parameters"}``.

Streamed "required" re-scans the whole text each step (the spans of a prefix are the
spans of the text cut short), so no state is kept beyond the text sent so far.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from frontend.tools.parsers.base import DeltaMessage, DeltaToolCall, ToolCall


def named_call(name: str, text: str) -> tuple[list[ToolCall], str | None]:
    if not text.strip():
        return [], None
    return [ToolCall(name, text)], None


def required_calls(text: str) -> tuple[list[ToolCall], str | None]:
    """vLLM's ``TypeAdapter(list[FunctionDefinition]).validate_json``: an array whose
    every item has a string name (parameters an object or null); anything else, no call."""
    try:
        items = json.loads(text)
    except ValueError:
        return [], None
    if not isinstance(items, list) or not all(_function_definition(i) for i in items):
        return [], None
    return [ToolCall(i["name"], json.dumps(i.get("parameters"), ensure_ascii=False)) for i in items], None


def _function_definition(item) -> bool:
    return (isinstance(item, dict) and isinstance(item.get("name"), str)
            and isinstance(item.get("parameters"), dict | None) and isinstance(item.get("description"), str | None)
            and all(isinstance(item.get(k), bool | None) for k in ("strict", "defer_loading")))


def named_delta(name: str, delta_text: str, name_sent: bool, new_id) -> DeltaMessage:
    """vLLM's ``extract_named_tool_call_streaming``: the first delta names the call,
    every delta carries its text as argument text."""
    if name_sent:
        return DeltaMessage(None, [DeltaToolCall(0, arguments=delta_text)], content_set=False)
    return DeltaMessage(None, [DeltaToolCall(0, id=new_id(), name=name, arguments=delta_text)], content_set=False)


@dataclass(slots=True)
class _Span:
    """One array item: its name once its string closed, and where its parameters are."""

    name: str | None = None
    name_end: int | None = None
    args_start: int | None = None
    args_end: int | None = None

    @property
    def ready(self) -> bool:
        return self.name is not None and self.args_start is not None

    def ready_at(self, length: int) -> bool:
        return self.ready and self.name_end <= length and self.args_start < length


EXPECT_KEY, EXPECT_COLON, EXPECT_VALUE, IN_STRING, IN_CONTAINER, IN_SCALAR, AFTER_VALUE = range(7)


class _Scan:
    """vLLM's ``_scan_required_tool_calls``: one string- and nesting-aware pass that
    reads only the array's items (depth 2)."""

    def __init__(self, text: str) -> None:
        self.text, self.spans = text, []
        self.cur: _Span | None = None
        self.expect, self.key, self.value_start = EXPECT_KEY, None, 0

    def end_value(self, pos: int) -> None:
        if self.key == "parameters":
            self.cur.args_end = pos
        elif self.key == "name" and self.expect == IN_STRING:
            try:
                self.cur.name, self.cur.name_end = json.loads(self.text[self.value_start:pos]), pos
            except json.JSONDecodeError:
                self.cur.name = None  # NOTE: never ready, as the whole answer's parse refuses it
        self.expect = AFTER_VALUE

    def start_value(self, pos: int, state: int) -> None:
        self.value_start = pos
        if self.key == "parameters":
            self.cur.args_start = pos
        self.expect = state

    def run(self) -> list[_Span]:  # noqa: C901 -- one character loop, as vLLM's
        text, depth, in_string, escaped, string_start = self.text, 0, False, False, 0
        for i, ch in enumerate(text):
            at_item = depth == 2 and self.cur is not None
            if in_string:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == '"':
                    in_string = False
                    if at_item and self.expect == EXPECT_KEY:
                        self.key, self.expect = text[string_start + 1 : i], EXPECT_COLON
                    elif at_item and self.expect == IN_STRING:
                        self.end_value(i + 1)
                continue
            if ch == '"':
                in_string, string_start = True, i
                if at_item and self.expect == EXPECT_VALUE:
                    self.start_value(i, IN_STRING)
            elif ch in "{[":
                if depth == 0 and ch != "[" or depth == 1 and ch != "{":
                    return self.spans
                if depth == 1:
                    self.cur = _Span()
                    self.spans.append(self.cur)
                    self.expect, self.key = EXPECT_KEY, None
                elif at_item and self.expect == EXPECT_VALUE:
                    self.start_value(i, IN_CONTAINER)
                depth += 1
            elif ch in "}]":
                if at_item and self.expect == IN_SCALAR:
                    self.end_value(i)
                depth -= 1
                if depth == 2 and self.cur is not None and self.expect == IN_CONTAINER:
                    self.end_value(i + 1)
                elif depth == 1:
                    self.cur = None
                elif depth <= 0:
                    return self.spans
            elif not at_item:
                continue
            elif ch == ":":
                if self.expect == EXPECT_COLON:
                    self.expect = EXPECT_VALUE
            elif ch == ",":
                if self.expect == IN_SCALAR:
                    self.end_value(i)
                self.expect, self.key = EXPECT_KEY, None
            elif ch.isspace():
                if self.expect == IN_SCALAR:
                    self.end_value(i)
            elif self.expect == EXPECT_VALUE:
                self.start_value(i, IN_SCALAR)
        return self.spans


def required_delta(previous_text: str, current_text: str, new_id) -> DeltaMessage | None:
    """vLLM's ``extract_required_tool_call_streaming``: every item with something not
    yet sent, in order; a call's first delta has its id, name and the arguments so far."""
    if not current_text:
        return None
    sent = len(previous_text)
    deltas: list[DeltaToolCall] = []
    for index, span in enumerate(_Scan(current_text).run()):
        if not span.ready:
            break  # NOTE: items come in order: nothing after an unready one is ready
        end = span.args_end if span.args_end is not None else len(current_text)
        if span.ready_at(sent):
            if new := current_text[min(end, sent):end]:
                # NOTE: as vLLM (and OpenAI), "name": null beside later argument text
                deltas.append(DeltaToolCall(index, arguments=new, null_name=True))
            continue
        deltas.append(DeltaToolCall(index, id=new_id(), name=span.name, arguments=current_text[span.args_start:end]))
    return DeltaMessage(None, deltas, content_set=False) if deltas else None
