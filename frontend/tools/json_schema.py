"""The JSON schema that forces a tool call when vLLM 0.32 runs with
VLLM_ENFORCE_STRICT_TOOL_CALLING=0 (its ``get_json_schema_from_tools``): a named
function's arguments alone, or, for "required", an array of ``{"name",
"parameters"}`` objects, one of the tools each (at most one with
``parallel_tool_calls: false``). It becomes the request's
``structured_outputs.json``; with vLLM's default the structural tag is used instead
(frontend.tools.structural_tag)."""

from __future__ import annotations

from typing import Any

from frontend.tools.choice import named_function, vllm_validation_error


def _params_or_empty_object(params: dict | None) -> dict:
    # NOTE: as vLLM: no parameters still constrains the arguments to a JSON object.
    return params if params else {"type": "object", "properties": {}}


def _tool_schema(function: dict) -> dict:
    return {
        "properties": {"name": {"type": "string", "enum": [function["name"]]}, "parameters": _params_or_empty_object(function.get("parameters"))},
        "required": ["name", "parameters"],
    }


def _schema_defs(functions: list[dict]) -> dict:
    """Every tool's ``$defs`` gathered at the top (taken out of its parameters, as vLLM's ``pop``)."""
    defs: dict[str, Any] = {}
    for fn in functions:
        params = fn.get("parameters")
        if params is None:
            continue
        tool_defs = params.pop("$defs", {})
        if not isinstance(tool_defs, dict):
            raise vllm_validation_error(f"`$defs` in the parameters of tool '{fn['name']}' must be an object, got {type(tool_defs).__name__}.", "tools")
        for name, schema in tool_defs.items():
            if name in defs and defs[name] != schema:
                raise vllm_validation_error(f"Tool definition '{name}' has multiple schemas, which is not supported.", "tools")
            defs[name] = schema
    return defs


def json_schema_from_tools(tool_choice: Any, tools: list[dict] | None, parallel_tool_calls: bool | None) -> dict | None:
    """The schema forcing ``tool_choice``'s call, or None ("none", "auto")."""
    if tool_choice in ("none", None) or tools is None:
        return None
    if (name := named_function(tool_choice)) is not None:
        return _params_or_empty_object(next(t["function"] for t in tools if t["function"]["name"] == name).get("parameters"))
    if tool_choice != "required":
        return None
    functions = [t["function"] for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [_tool_schema(f) for f in functions]}}
    if parallel_tool_calls is False:  # NOTE: only an explicit false; None is the default (true)
        schema["maxItems"] = 1
    if defs := _schema_defs(functions):
        schema["$defs"] = defs
    return schema
