"""A request's own structured-outputs constraint as an xgrammar format, for the one
case vLLM 0.32 joins it with the tool-call tag (``tool_choice: "auto"`` when a tag
applies): the model either calls a tool or writes the constrained answer
(``parser/abstract_parser.structured_outputs_to_format``, with
``structured_outputs_from_response_format`` and ``_xgrammar_supports``).

None when the constraint is one xgrammar cannot take: then, as vLLM, the calls are
left unconstrained and the request's constraint applies alone."""

from __future__ import annotations

import json
import re
from typing import Any

_KINDS = ("json_object", "json", "regex", "choice", "grammar", "structural_tag")


def _constraint(req) -> dict[str, Any]:
    """vLLM's ``extract_structured_outputs``: ``structured_outputs`` with a
    ``response_format`` other than text over it."""
    so = req.structured_outputs
    given = {k: getattr(so, k) for k in _KINDS if so is not None and getattr(so, k) is not None}
    rf = getattr(req, "response_format", None)  # NOTE: a field of issue 23's structured outputs
    if isinstance(rf, dict) and rf.get("type") == "json_object":
        given["json_object"] = True
    elif isinstance(rf, dict) and rf.get("type") == "json_schema":
        given["json"] = (rf.get("json_schema") or {}).get("schema")
    elif isinstance(rf, dict) and rf.get("type") not in (None, "text"):
        given["structural_tag"] = json.dumps(rf)
    return given


def grammar_is_likely_lark(grammar: str) -> bool:
    """vLLM's heuristic: a grammar with no ``::=`` rule is Lark."""
    for line in grammar.split("\n"):
        line = re.sub(r"(#|//).*$", "", line).strip()
        if "::=" in line:
            return False
    return bool(grammar)


def output_format(req):
    """The constraint's xgrammar format, or None (none given, or xgrammar refuses it)."""
    import xgrammar as xgr
    from xgrammar.structural_tag import (
        ConstStringFormat,
        GrammarFormat,
        JSONSchemaFormat,
        OrFormat,
        RegexFormat,
    )

    given = _constraint(req)
    try:
        if given.get("json_object"):
            return JSONSchemaFormat(json_schema={"type": "object"})
        if (schema := given.get("json")) is not None:
            schema = json.loads(schema) if isinstance(schema, str) else schema
            xgr.Grammar.from_json_schema(json.dumps(schema))
            return JSONSchemaFormat(json_schema=schema)
        if (pattern := given.get("regex")) is not None:
            xgr.Grammar.from_regex(pattern)
            return RegexFormat(pattern=pattern)
        if (choices := given.get("choice")) is not None:
            return OrFormat(elements=[ConstStringFormat(value=c) for c in choices]) if choices else None
        if (grammar := given.get("grammar")) is not None:
            grammar = str(xgr.Grammar.from_lark(grammar)) if grammar_is_likely_lark(grammar) else grammar
            xgr.Grammar.from_ebnf(grammar)
            return GrammarFormat(grammar=grammar)
    except Exception:  # NOTE: as vLLM's _xgrammar_supports: a constraint xgrammar refuses is not joined
        return None
    return None  # NOTE: a structural tag of the request's own is not joined here
