"""A chat answer's tool calls, read from the model's text by the configured parser, as
vLLM 0.32's chat serving builds them: the whole answer's ``message`` (content and
``tool_calls``) and ``finish_reason``, or, streamed, each step's ``delta``.

The parser exists only with ``--enable-auto-tool-choice --tool-call-parser``. Then, as
vLLM's with these parsers, "auto", "required" and a named function are all read from
the parser's own format (the structural tag made the model write it), "none" is text.
A call makes the finish reason "tool_calls" where vLLM says so: a call found under
"auto" (or, streamed, any call but a named one), and "required" whenever the model
stopped by itself; a named call keeps "stop", as OpenAI's.
"""

from __future__ import annotations

from frontend.tools.choice import named_function
from frontend.tools.parsers.base import DeltaMessage, ToolCall, ToolParser, make_tool_call_id
from frontend.tools.parsers.forced_json import (
    named_call,
    named_delta,
    required_calls,
    required_delta,
)


def _parse(parser: ToolParser, req, text: str, forced_json: bool) -> tuple[list[ToolCall] | None, str | None]:
    """vLLM's ``DelegatingParser._extract_tool_calls``: required/named read as JSON
    with ``forced_json`` (VLLM_ENFORCE_STRICT_TOOL_CALLING=0), else in the parser's format."""
    if req.tool_choice == "none":
        return [], text
    name = named_function(req.tool_choice)
    if forced_json and name is not None:
        return named_call(name, text)
    if forced_json and req.tool_choice == "required":
        return required_calls(text)
    forced = req.tool_choice == "required" or name is not None
    info = parser.extract_tool_calls(text)
    if info.tools_called:
        content = info.content
        return info.tool_calls, None if content and not content.strip() else content
    if forced and not text.strip():
        return [], None
    return None, text


def chat_message(parser_cls: type[ToolParser] | None, tokenizer, req, role: str, text: str,
                 finish_reason: str | None, forced_json: bool = False) -> tuple[dict, str | None]:
    """(message, finish_reason) of one whole choice."""
    if parser_cls is None:
        return {"role": role, "content": text}, finish_reason
    calls, content = _parse(parser_cls(tokenizer), req, text, forced_json)
    choice = req.tool_choice
    message: dict = {"role": role, "content": content}
    auto_called = False
    if choice == "required" or named_function(choice) is not None:
        message = {"role": role, "content": content or "", "tool_calls": calls or []}
    elif choice == "auto" and req.tools:
        auto_called = bool(calls)
        if calls:
            message["tool_calls"] = calls
    if req.parallel_tool_calls is False and message.get("tool_calls"):
        message["tool_calls"] = message["tool_calls"][:1]
    if message.get("tool_calls"):
        message["tool_calls"] = [c.to_json() for c in message["tool_calls"]]
    else:
        message.pop("tool_calls", None)  # NOTE: vLLM 0.32's ChatMessage leaves out an empty list
    if auto_called or (choice == "required" and finish_reason == "stop"):
        finish_reason = "tool_calls"
    return message, finish_reason


class StreamedToolCalls:
    """One streamed choice's parser and what it has sent (vLLM's ``parse_delta`` with a
    tool parser and no reasoning parser)."""

    def __init__(self, parser_cls: type[ToolParser], tokenizer, req, forced_json: bool = False) -> None:
        self.parser = parser_cls(tokenizer)
        self.req = req
        self.previous_text = ""
        self.tools_streamed = False
        self.forced_name = named_function(req.tool_choice) if forced_json else None
        self.forced_required = forced_json and req.tool_choice == "required"
        self.name_sent = False  # a forced named call's first delta went out

    def delta(self, delta_text: str, finished: bool) -> dict | None:
        """The step's delta as sent, or None: nothing to send yet."""
        current_text = self.previous_text + delta_text
        if self.req.tool_choice == "none":
            message = DeltaMessage(delta_text) if delta_text else None
        elif self.forced_name is not None:
            message, self.name_sent = named_delta(self.forced_name, delta_text, self.name_sent, make_tool_call_id), True
        elif self.forced_required:
            message = required_delta(self.previous_text, current_text, make_tool_call_id)
        else:
            message = self.parser.extract_tool_calls_streaming(self.previous_text, current_text, delta_text)
        self.previous_text = current_text
        if finished and message is not None and message.tool_calls:
            # NOTE: as vLLM, the last delta carries any argument text parsed but not sent.
            last = message.tool_calls[-1]
            last.arguments = (last.arguments or "") + self.parser.get_remaining_unstreamed_args()
        if message is None:
            return None
        if message.tool_calls:
            self.tools_streamed = True
            if self.req.parallel_tool_calls is False:
                message.tool_calls = [t for t in message.tool_calls if t.index == 0]
        return message.to_json()

    def finish_reason(self, finish_reason: str) -> str:
        if self.tools_streamed and named_function(self.req.tool_choice) is None and finish_reason == "stop":
            return "tool_calls"
        return finish_reason


def logged_output(message: dict) -> str:
    """What --enable-log-outputs logs of a whole answer (vLLM's words): its content,
    else its calls."""
    if message.get("content"):
        return message["content"]
    if calls := message.get("tool_calls"):
        return "[tool_calls: " + ", ".join(f"{c['function']['name']}({c['function']['arguments']})" for c in calls) + "]"
    return ""


def logged_delta(delta: dict) -> str:
    """What it logs of a streamed delta: its content and its calls' argument text."""
    parts = [delta["content"]] if delta.get("content") else []
    if args := "".join(t["function"]["arguments"] for t in delta.get("tool_calls", []) if t.get("function", {}).get("arguments")):
        parts.append(f"[tool_calls: {args}]")
    return " ".join(parts)
