"""A chat request's messages as vLLM 0.32 hands them to the chat template
(``vllm/renderers/chat_utils.py``, ``parse_chat_messages``), text only.

Each message becomes a new dict of the fields vLLM keeps: ``role`` and ``content`` --
in the "string" format its text parts joined with new lines (none is ""), in the
"openai" format (``frontend.text.content_format``) a list of ``{"type": "text", "text"}``
parts, a string content made one part (a tool message's all-text parts are joined
into a string all the same) -- an assistant's ``tool_calls``
(their ``arguments`` parsed from JSON into a dict, as transformers' templates expect;
an empty list dropped) and ``reasoning`` (also as ``reasoning_content``), a tool
message's ``tool_call_id``, a string ``name`` or ``task``, a developer message's
``tools``. Other keys are not seen by the template. A part that is not text (an
image, audio) is refused: kvpool serves text-only models.
"""

from __future__ import annotations

import json

from frontend.schema.errors import bad_request

# vLLM's TEXT_PART_TYPES and the key each keeps its text under.
_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal", "thinking": "thinking"}
_SKIP_WITHOUT_CONTENT = ("text", "refusal")


# vLLM's _KNOWN_CONTENT_PART_FIELDS: in the "openai" format, a text part keeps its other keys.
_KNOWN_PART_FIELDS = frozenset(("audio_embeds", "audio_url", "closed", "data", "file", "image_embeds", "image_pil", "image_url",
                                "input_audio", "name", "prompt_cache_breakpoint", "refusal", "text", "thinking", "type", "uuid",
                                "video_embeds", "video_url"))


def _text_part(i: int, part) -> str | None:
    if isinstance(part, str):
        return part
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in _TEXT_PARTS:
        raise bad_request(f"messages[{i}]: only text content parts are supported", "messages")
    text = part.get(_TEXT_PARTS[kind])
    if text is None and kind in _SKIP_WITHOUT_CONTENT:
        return None
    return text if isinstance(text, str) else str(text)


def _content(i: int, content, parts: bool) -> str | list[dict]:
    if content is None:
        content = []
    elif isinstance(content, str):
        content = [content]
    elif not isinstance(content, list):
        raise bad_request(f"messages[{i}].content must be a string or a list of content parts", "messages")
    texts = [(p, t) for p in content if (t := _text_part(i, p)) is not None]
    if not parts:
        return "\n".join(t for _, t in texts)
    return [{"type": "text", "text": t, **({k: v for k, v in p.items() if k not in _KNOWN_PART_FIELDS} if isinstance(p, dict) else {})}
            for p, t in texts]


def _arguments(function: dict) -> None:
    """vLLM's ``_postprocess_messages``: a tool call's arguments as a dict; JSON that is
    not an object, or not JSON, becomes {} (the conversation can go on)."""
    args = function.get("arguments")
    if not args:
        function["arguments"] = {}
        return
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            args = None
    function["arguments"] = args if isinstance(args, dict) else {}


def _tool_calls(calls: list) -> list:
    out = []
    for call in calls:
        if not isinstance(call, dict):
            raise bad_request("assistant tool_calls entries must be objects. (parameter=tool_calls)", "tool_calls")
        function = call.get("function")
        if call.get("type", "function") != "function" or not isinstance(function, dict):
            raise bad_request("chat completions only support assistant tool_calls of type 'function'. (parameter=tool_calls)",
                              "tool_calls")
        call = {**call, "function": dict(function)}
        _arguments(call["function"])
        out.append(call)
    return out


def conversation(messages: list[dict], content_format: str = "string") -> list[dict]:
    """The messages as the chat template sees them, in ``content_format`` ("string" or "openai")."""
    out = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if not isinstance(role, str):
            raise bad_request(f"messages[{i}] has no role", "messages")
        msg = {"role": role, "content": _content(i, m.get("content"), content_format == "openai" and role != "tool")}
        if role == "assistant":
            if isinstance(m.get("tool_calls"), list) and m["tool_calls"]:
                msg["tool_calls"] = _tool_calls(m["tool_calls"])
            if m.get("reasoning") is not None:
                msg["reasoning"] = msg["reasoning_content"] = m["reasoning"]
        elif role == "tool" and "tool_call_id" in m:
            msg["tool_call_id"] = m["tool_call_id"]
        for key in ("name", "task"):
            if isinstance(m.get(key), str):
                msg[key] = m[key]
        if role == "developer":
            msg["tools"] = m.get("tools")
        out.append(msg)
    return out
