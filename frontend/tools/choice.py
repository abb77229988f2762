"""A chat request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, checked and
applied as vLLM 0.32 does: its ``ChatCompletionRequest`` validators, the renderer's
refusals without a tool parser, and the tools as the chat template sees them. The
constraint that forces the calls is frontend/tools/constraint.py's."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

import msgspec

from frontend.schema.errors import APIError, bad_request
from frontend.schema.requests import ChatCompletionRequest
from frontend.tools.parsers.base import ToolParser

_CORRECT_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
# A function's fields, as pydantic types them: (type, error type, message).
_FUNCTION_FIELDS = {
    "name": (str, "string_type", "Input should be a valid string"),
    "description": (str, "string_type", "Input should be a valid string"),
    "parameters": (dict, "dict_type", "Input should be a valid dictionary"),
    "strict": (bool, "bool_type", "Input should be a valid boolean"),
    "defer_loading": (bool, "bool_type", "Input should be a valid boolean"),
}


def vllm_validation_error(message: str, param: str | None = None) -> APIError:
    """vLLM's ``VLLMValidationError``, as its answer words it: the parameter named in the message too."""
    return bad_request(f"{message} (parameter={param})" if param else message, param)


def named_function(tool_choice: Any) -> str | None:
    """The function a named tool_choice forces, else None."""
    return tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None


def check_tool_usage(req: ChatCompletionRequest) -> None:
    """vLLM's request validation of tools: its ``check_tool_usage`` validator (which
    resolves an unset tool_choice: "auto" with tools, else "none"), its
    ``check_structured_outputs_count`` beside a named tool, then pydantic's types of
    the tools and the named choice -- in vLLM's order."""
    _check_tool_usage(req)
    choice = req.tool_choice
    if isinstance(choice, dict) and req.structured_outputs is not None:
        count = sum(getattr(req.structured_outputs, k) is not None for k in ("json", "regex", "choice"))
        if count > 1:
            raise vllm_validation_error("You can only use one kind of constraints for structured outputs ('json', 'regex' or 'choice').")
        if count:
            raise vllm_validation_error("You can only either use constraints for structured outputs or tools, not both.")
    check_tools(req.tools)
    if isinstance(choice, dict) and choice.get("type", "function") != "function":
        shown = _shown(choice)
        raise _validation_error([
            *({"type": "literal_error", "loc": "body.tool_choice", "msg": f"Input should be '{v}'", "input": shown, "ctx": {"expected": f"'{v}'"}}
              for v in ("none", "auto", "required")),
            {"type": "literal_error", "loc": "body.tool_choice.type", "msg": "Input should be 'function'", "input": _shown(choice["type"]),
             "ctx": {"expected": "'function'"}},
        ])


def _check_tool_usage(req: ChatCompletionRequest) -> None:
    if req.tools == []:
        raise vllm_validation_error("`tools` must not be an empty array. Either provide at least one tool or omit the field entirely.", "tools")
    if req.tool_choice is msgspec.UNSET:
        req.tool_choice = "auto" if req.tools else "none"
    choice = req.tool_choice
    if choice is None or choice == "none":
        return
    if req.tools is None:
        raise vllm_validation_error("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if choice not in ("auto", "required") and not isinstance(choice, dict):
        raise vllm_validation_error(f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", "auto" or "required" are supported.',
                                    "tool_choice")
    if isinstance(choice, dict):
        _check_named(choice, req.tools)


def check_tools(tools: list | None) -> None:
    """Each tool as vLLM's ``ChatCompletionToolsParam`` types it (also /tokenize's)."""
    for i, tool in enumerate(tools or ()):
        _check_tool(i, tool)


def _validation_error(errors: list[dict]) -> APIError:
    """pydantic's refusal of a body as vLLM words it: each error's dict, one a line."""
    label = "error" if len(errors) == 1 else "errors"
    message = f"{len(errors)} validation {label}:\n" + "\n".join(f"  {e}" for e in errors)
    return APIError(message, HTTPStatus.BAD_REQUEST, errors[0]["loc"], "Bad Request")


def _shown(value: Any) -> str:
    """A value as vLLM's validation errors show it: a container by its size."""
    if isinstance(value, list | dict):
        return f"<{type(value).__name__} of {len(value)} items>"
    return str(value)


def _check_tool(i: int, tool: Any) -> None:
    """A tool as vLLM's ``ChatCompletionToolsParam`` types it."""
    where = f"body.tools.{i}"
    if not isinstance(tool, dict):
        raise _validation_error([{"type": "model_attributes_type", "loc": where,
                                  "msg": "Input should be a valid dictionary or object to extract fields from", "input": _shown(tool)}])
    if tool.get("type", "function") != "function":
        raise _validation_error([{"type": "literal_error", "loc": f"{where}.type", "msg": "Input should be 'function'",
                                  "input": _shown(tool["type"]), "ctx": {"expected": "'function'"}}])
    function = tool.get("function")
    if function is None:
        raise _validation_error([{"type": "missing", "loc": f"{where}.function", "msg": "Field required", "input": _shown(tool)}])
    if not isinstance(function, dict):
        raise _validation_error([{"type": "model_attributes_type", "loc": f"{where}.function",
                                  "msg": "Input should be a valid dictionary or object to extract fields from", "input": _shown(function)}])
    if "name" not in function:
        raise _validation_error([{"type": "missing", "loc": f"{where}.function.name", "msg": "Field required", "input": _shown(function)}])
    for key, (kind, type_, msg) in _FUNCTION_FIELDS.items():
        value = function.get(key)
        if (value is not None or key == "name") and not (isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))):
            raise _validation_error([{"type": type_, "loc": f"{where}.function.{key}", "msg": msg, "input": _shown(value)}])


def _check_named(choice: dict, tools: list[dict]) -> None:
    function = choice.get("function")
    if not isinstance(function, dict):
        raise vllm_validation_error(f"Invalid value for `function`: `{function}` in `tool_choice`! {_CORRECT_USAGE}", "tool_choice.function")
    if "name" not in function:
        raise vllm_validation_error(f"Expected field `name` in `function` in `tool_choice`! {_CORRECT_USAGE}", "tool_choice.function.name")
    name = function["name"]
    if not isinstance(name, str) or not name:
        raise vllm_validation_error(f"Invalid `name` in `function`: `{name}` in `tool_choice`! {_CORRECT_USAGE}", "tool_choice.function.name")
    # NOTE: a malformed tool is pydantic's to refuse, after this check (vLLM's KeyError there is a 500)
    if not any(isinstance(t, dict) and isinstance(t.get("function"), dict) and t["function"].get("name") == name for t in tools):
        raise vllm_validation_error("The tool specified in `tool_choice` does not match any of the specified `tools`", "tool_choice")


def check_tool_parsing(req: ChatCompletionRequest, parser_cls: type[ToolParser] | None) -> None:
    """vLLM's renderer: without a tool parser (both --enable-auto-tool-choice and
    --tool-call-parser), only "none" (or null) may be asked for."""
    choice = req.tool_choice
    if parser_cls is not None or choice is None or choice == "none":
        return
    if choice == "auto":
        raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set')
    desc = f'function "{named_function(choice)}"' if isinstance(choice, dict) else f'"{choice}"'
    raise bad_request(f"tool_choice={desc} requires --tool-call-parser to be set")


def template_tools(tools: list[dict] | None) -> list[dict] | None:
    """The tools as vLLM hands them to the chat template (``tool.model_dump()``): each
    function's description and parameters always there (None if not given), strict
    and defer_loading only when set, unknown keys dropped."""
    if tools is None:
        return None
    out = []
    for tool in tools:
        fn = tool["function"]
        defer = tool.get("defer_loading")
        function = {"name": fn["name"], "description": fn.get("description"), "parameters": fn.get("parameters")}
        if fn.get("strict") is not None:
            function["strict"] = fn["strict"]
        if (fn_defer := fn.get("defer_loading", defer)) is not None:
            function["defer_loading"] = fn_defer
        dumped = {"type": "function", "function": function}
        if defer is not None:
            dumped["defer_loading"] = defer
        out.append(dumped)
    return out


def requested_constraint(req) -> bool:
    """Whether the request asks for structured outputs itself (vLLM's
    ``extract_structured_outputs``: ``structured_outputs``, or a ``response_format``
    other than text)."""
    response_format = getattr(req, "response_format", None)  # NOTE: a field of issue 23's structured outputs
    return req.structured_outputs is not None or (isinstance(response_format, dict) and response_format.get("type") != "text")
