"""Earlier tool calls in a chat's messages, as vLLM 0.32 hands them to the chat
template (``renderers/chat_utils._postprocess_messages``): an assistant message's
``tool_calls[i].function.arguments`` as an object, not the JSON text the OpenAI API
carries -- what tool-use templates (and transformers' docs) expect."""

from __future__ import annotations

import json
import logging

from frontend.tool_choice import vllm_validation_error

log = logging.getLogger("frontend")


def _arguments(function: dict) -> dict:
    """The arguments as an object; none, or text that is not a JSON object, is {}."""
    args = function.get("arguments")
    if not args:
        return {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            # NOTE: as vLLM: bad arguments in the history would fail every later turn too.
            log.warning("Tool call %r has arguments that are not valid JSON (%d chars); coercing to an empty object "
                        "so the conversation can continue.", function.get("name"), len(args))  # fmt: skip
            return {}
    return args if isinstance(args, dict) else {}


def with_tool_call_arguments(messages: list[dict]) -> list[dict]:
    """``messages`` with each assistant tool call's arguments parsed (the request's own
    dicts left as they are); an empty ``tool_calls`` is dropped."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if m.get("role") != "assistant" or not isinstance(calls, list):
            out.append(m)
            continue
        m = dict(m)
        if not calls:
            m.pop("tool_calls")  # NOTE: keeps templates on the plain assistant path
            out.append(m)
            continue
        parsed = []
        for call in calls:
            if not isinstance(call, dict):
                raise vllm_validation_error("assistant tool_calls entries must be objects.", "tool_calls")
            function = call.get("function")
            if call.get("type", "function") != "function" or not isinstance(function, dict):
                raise vllm_validation_error("chat completions only support assistant tool_calls of type 'function'.", "tool_calls")
            parsed.append({**call, "function": {**function, "arguments": _arguments(function)}})
        m["tool_calls"] = parsed
        out.append(m)
    return out
