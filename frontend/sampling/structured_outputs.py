"""A request's structured outputs (``structured_outputs``, ``response_format``) into
the engine's ``GrammarSpec``, with vLLM 0.32's checks and words.

As vLLM: ``response_format`` overrides ``structured_outputs``
(``structured_outputs_from_response_format``: json_object -> json_object,
json_schema -> its ``schema``); exactly one constraint; then
``SamplingParams._validate_structured_outputs`` and, for the xgrammar backend,
``validate_xgrammar_grammar``: xgrammar parses the regex, the choices (as an EBNF of
alternatives), the JSON schema or the grammar here, in the API server, so that a spec
that cannot compile is a 400 before the engine sees it. The parse runs in a thread
(``grammar_spec_of`` is called through ``asyncio.to_thread``), never on the event loop.

vLLM's xgrammar backend reads ``disable_any_whitespace`` from the server's config, not
the request, and ``disable_additional_properties`` / ``whitespace_pattern`` belong to
other backends: with xgrammar vLLM accepts and does not use them, and so does kvpool.
``structural_tag`` is parsed and compiled as vLLM's xgrammar backend does (both of its
forms; forced tool calls are made of one); a ``response_format`` of type
``structural_tag`` is refused by name (vLLM rebuilds it through pydantic's dump).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from frontend.sampling.params import EngineParams
from frontend.schema.errors import bad_request
from frontend.schema.requests import StructuredOutputsParams
from protocol.structured_output import GrammarSpec, structural_tag_args

# vLLM's MAX_STRUCTURED_OUTPUT_JSON_NESTING.
MAX_JSON_NESTING = 64
_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# xgrammar's supported string formats (vLLM's STRING_SUPPORTED_FORMATS).
_STRING_FORMATS = {"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri",
                   "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"}


def load_xgrammar():
    import xgrammar  # NOTE: heavy (it loads torch and transformers): only at the first such request

    return xgrammar


def merged_structured_outputs(req) -> StructuredOutputsParams | None:
    """vLLM's ``structured_outputs_from_response_format`` (with its request-model checks)."""
    so, rf = req.structured_outputs, req.response_format
    if so is not None and sum(getattr(so, k) is not None for k in ("json", "regex", "choice")) > 1:
        message = "You can only use one kind of constraints for structured outputs ('json', 'regex' or 'choice')."
        # NOTE: vLLM's chat request raises it without naming the parameter, its completion request with.
        if hasattr(req, "messages"):
            raise bad_request(message)
        raise bad_request(f"{message} (parameter=structured_outputs)", "structured_outputs")
    if rf is None:
        return so
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema", "structural_tag"):
        raise bad_request("response_format.type must be one of 'text', 'json_object', 'json_schema', 'structural_tag'",
                          "response_format")
    kind = rf["type"]
    if kind == "text":
        return so
    if kind == "structural_tag":
        raise bad_request("response_format of type 'structural_tag' is not supported by kvpool", "response_format")
    if kind == "json_object":
        overrides = {"json_object": True}
    else:
        schema = rf.get("json_schema")
        if schema is None:
            raise bad_request("When response_format type is 'json_schema', the 'json_schema' field must be provided. "
                              "(parameter=response_format)", "response_format")
        if not isinstance(schema, dict):
            raise bad_request("response_format.json_schema must be an object", "response_format")
        overrides = {"json": schema.get("schema")}
    fields = {} if so is None else {k: getattr(so, k) for k in so.__struct_fields__}
    return StructuredOutputsParams(**{**fields, **overrides})


def grammar_spec_of(req) -> GrammarSpec | None:
    """The request's grammar as the engine compiles it, or None; a 400 in vLLM's
    words when it has none, several, or one xgrammar cannot parse."""
    so = merged_structured_outputs(req)
    if so is None:
        return None
    given = {k: getattr(so, k) for k in _CONSTRAINTS if getattr(so, k) is not None}
    if len(given) != 1:
        what = "multiple are specified" if given else "none are specified"
        kind = "can only" if given else "must"
        raise bad_request(f"You {kind} use one kind of structured outputs constraint but {what}: {_as_dict(so)}")
    (kind, value), = given.items()
    _check_request_content(kind, value)
    return _validate_xgrammar(kind, value)


def _as_dict(so: StructuredOutputsParams) -> dict:
    d = {k: getattr(so, k) for k in so.__struct_fields__}
    return {**d, "_backend": None, "_backend_was_auto": False}


def _check_request_content(kind: str, value: Any) -> None:
    """vLLM's ``_validate_structured_outputs``, before the backend's checks."""
    if kind == "choice" and not value:
        raise bad_request(f"Choice '{value}' cannot be an empty list")
    if kind == "grammar" and value.strip() == "":
        raise bad_request("structured_outputs.grammar cannot be an empty string")
    if kind == "json" and isinstance(value, str) and value.strip() == "":
        raise bad_request("structured_outputs.json cannot be an empty string")
    if kind == "json" and value and _exceeds_json_nesting(value, MAX_JSON_NESTING):
        raise bad_request("The JSON schema is nested too deeply: objects and arrays may nest at most "
                          f"{MAX_JSON_NESTING} levels")
    if kind == "json_object" and value is False:
        raise bad_request("structured_outputs.json_object must be True if set; omit structured_outputs to disable "
                          "structured outputs")
    if kind == "regex" and "\x00" in value:
        raise bad_request("structured_outputs.regex must not contain a NUL character ('\\x00')")
    if kind == "structural_tag" and _exceeds_json_nesting(value, MAX_JSON_NESTING):
        raise bad_request("The JSON schema is nested too deeply: objects and arrays may nest at most "
                          f"{MAX_JSON_NESTING} levels")


def _validate_xgrammar(kind: str, value: Any) -> GrammarSpec:
    """vLLM's ``validate_xgrammar_grammar``: parse with xgrammar; the spec to compile."""
    xgr = load_xgrammar()
    if kind == "regex":
        try:
            compile_regex_with_timeout(xgr.Grammar.from_regex, value)
        except Exception as err:
            raise bad_request(sanitize_message(f"Failed to transform regex into a grammar: {err}")) from None
        return GrammarSpec("regex", value)
    if kind == "choice":
        grammar = choice_as_grammar(value)
        try:
            xgr.Grammar.from_ebnf(grammar)
        except Exception as err:
            raise bad_request(sanitize_message(f"Failed to transform choices into a grammar: {err}")) from None
        return GrammarSpec("ebnf", grammar)
    if kind == "json":
        if isinstance(value, str):
            try:
                schema = json.loads(value)
            except json.JSONDecodeError:
                raise bad_request("Invalid JSON grammar specification.") from None
        else:
            schema = value
        if has_xgrammar_unsupported_json_features(schema):
            raise bad_request("The provided JSON schema contains features not supported by xgrammar.")
        try:
            xgr.Grammar.from_json_schema(schema if isinstance(schema, str) else json.dumps(schema))
        except Exception as err:
            raise bad_request(sanitize_message(f"Failed to transform json schema into a grammar: {err}")) from None
        # NOTE: vLLM compiles json.dumps(schema) when it came as an object, the string as given otherwise.
        return GrammarSpec("json", value if isinstance(value, str) else json.dumps(value))
    if kind == "grammar":
        lark = grammar_is_likely_lark(value)
        try:
            xgr.Grammar.from_lark(value) if lark else xgr.Grammar.from_ebnf(value)
        except Exception:
            raise bad_request("Invalid grammar specification.") from None
        return GrammarSpec("lark" if lark else "ebnf", value)
    if kind == "structural_tag":
        try:
            xgr.Grammar.from_structural_tag(*structural_tag_args(xgr, value))
        except Exception:
            raise bad_request("Invalid structural tag specification.") from None
        return GrammarSpec("structural_tag", value)
    return GrammarSpec("json_object")


def sanitize_message(message: str) -> str:
    """vLLM's (``exception_handling/utils.py``), which every error it answers passes
    through: no memory addresses, tracebacks or file paths (xgrammar's messages name
    its C++ sources)."""
    message = re.sub(r" at 0x[0-9a-fA-F]+>", ">", message)
    message = re.sub(r'\n?\s*File "[^"]+", line \d+, in \S+(\n\s+.*)?', "", message)
    message = re.sub(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+", "<path>", message)
    message = re.sub(r"(?:/[\w\-]+)+/[\w\-]+\.\w+", "<path>", message)
    return message.strip()


def regex_timeout_s() -> int:
    """vLLM's VLLM_REGEX_COMPILATION_TIMEOUT_S (default 5; 0 or less: none)."""
    return int(os.environ.get("VLLM_REGEX_COMPILATION_TIMEOUT_S", "5"))


def compile_regex_with_timeout(fn, pattern: str):
    """vLLM's: ``fn(pattern)`` on a thread of its own, a ValueError past the timeout
    (a pattern whose automaton explodes); the thread is left to finish, as vLLM's."""
    timeout = regex_timeout_s()
    if timeout <= 0:
        return fn(pattern)
    executor = ThreadPoolExecutor(max_workers=1)
    future = executor.submit(fn, pattern)
    try:
        return future.result(timeout=timeout)
    except TimeoutError:
        raise ValueError(
            f"Regex compilation timed out after {timeout}s. The pattern may be too complex or contain constructs that "
            f"cause exponential state-space explosion (e.g. nested quantifiers). Pattern: {pattern[:200]}"
        ) from None
    finally:
        executor.shutdown(wait=False, cancel_futures=True)


def choice_as_grammar(choice: list[str]) -> str:
    """vLLM's ``choice_as_grammar``: an EBNF root of one quoted alternative per choice."""
    escapes = {"\\": r"\\", '"': r"\"", "\n": r"\n", "\r": r"\r", "\t": r"\t"}

    def escape_char(ch: str) -> str:
        if ch in escapes:
            return escapes[ch]
        if ord(ch) < 0x20 or ord(ch) == 0x7F:
            return f"\\u{ord(ch):04x}"
        return ch

    return "root ::= " + " | ".join('"' + "".join(map(escape_char, c)) + '"' for c in choice)


def grammar_is_likely_lark(grammar: str) -> bool:
    """vLLM's: Lark unless some line (comments removed) defines a rule with ``::=``."""
    if not grammar or not isinstance(grammar, str):
        return False
    for line in grammar.split("\n"):
        line = re.sub(r"(#|//).*$", "", line).strip()
        if line and "::=" in line:
            return False
    return True


def _exceeds_json_nesting(spec: str | dict, limit: int) -> bool:
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except RecursionError:
            return True
        except ValueError:
            return False
    level: list[Any] = [spec]
    for _ in range(limit):
        level = [child for node in level if isinstance(node, (dict, list))
                 for child in (node.values() if isinstance(node, dict) else node) if isinstance(child, (dict, list))]
        if not level:
            return False
    return True


def _types(schema: dict) -> set[str]:
    t = schema.get("type")
    return {t} if isinstance(t, str) else {x for x in t if isinstance(x, str)} if isinstance(t, list) else set()


def _pattern_and_length(schema: dict) -> bool:
    return ("pattern" in schema or "format" in schema) and ("minLength" in schema or "maxLength" in schema)


def has_xgrammar_unsupported_json_features(schema: Any) -> bool:
    """vLLM's ``has_xgrammar_unsupported_json_features``: the schema keywords xgrammar
    would silently not enforce, anywhere in the schema."""
    if not isinstance(schema, dict):
        return False
    types = _types(schema)
    if types & {"integer", "number"} and "multipleOf" in schema:
        return True
    if "array" in types and any(k in schema for k in ("uniqueItems", "contains", "minContains", "maxContains")):
        return True
    if "string" in types and "format" in schema and schema["format"] not in _STRING_FORMATS:
        return True
    if "string" in types and _pattern_and_length(schema):
        return True
    if "object" in types and "propertyNames" in schema:
        names = schema.get("propertyNames")
        if (isinstance(names, dict) and _pattern_and_length(names)) or "patternProperties" in schema or "properties" in schema:
            return True
        if schema.get("unevaluatedProperties", True) is not True:
            return True
    if "object" in types and isinstance(schema.get("patternProperties"), dict):
        if "properties" in schema or len(schema["patternProperties"]) > 1:
            return True
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) >= 2:
        return True
    for value in schema.values():
        if isinstance(value, dict) and has_xgrammar_unsupported_json_features(value):
            return True
        if isinstance(value, list) and any(isinstance(v, dict) and has_xgrammar_unsupported_json_features(v) for v in value):
            return True
    return False


async def with_structured_outputs(params: EngineParams, req) -> EngineParams:
    """``params`` with the request's grammar (checked in a thread), if it asks for one."""
    if req.structured_outputs is None and req.response_format is None:
        return params
    spec = await asyncio.to_thread(grammar_spec_of, req)
    if spec is None:
        return params
    return replace(params, generate={**params.generate, "structured_outputs": spec})
