"""A request's structured-output constraint as it travels: frontend -> scheduler
(``Generate.structured_outputs``) -> worker (with the row, and in ``CompileGrammars``).

The frontend has already validated it the way vLLM's API server does (xgrammar parses
it there, so a bad one is a 400); what travels is the one string xgrammar compiles and
how to compile it, vLLM's ``structured_output_key``: ``choice`` has become an EBNF
grammar, and a ``grammar`` is marked EBNF or Lark as vLLM's ``grammar_is_likely_lark``
decided. The scheduler never compiles nor reads it: it only waits for the worker to say
a request's grammar is ready (vLLM's WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR).
"""

from __future__ import annotations

import json

import msgspec

# vLLM's StructuredOutputOptions as xgrammar compiles them (choice travels as "ebnf").
GRAMMAR_KINDS = ("json", "json_object", "regex", "ebnf", "lark", "structural_tag")


class GrammarSpec(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """What xgrammar compiles: ``kind`` (one of GRAMMAR_KINDS) and its text (a JSON
    schema, a regex, a grammar; "" for json_object). Hashable: the compile cache's key."""

    kind: str
    spec: str = ""


class RowGrammar(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A row's grammar on the worker wire, with the tokens that end it: vLLM overrides
    the matcher's stop tokens with the request's ``all_stop_token_ids`` (its
    stop_token_ids and every EOS id, even with ignore_eos)."""

    spec: GrammarSpec
    stop_token_ids: list[int] = []


def structural_tag_args(xgr, spec: str) -> tuple:
    """What xgrammar's ``Grammar.from_structural_tag`` / ``compile_structural_tag`` take
    for a structural tag, as vLLM's xgrammar backend reads one: the JSON as it is, or in
    xgrammar's deprecated form (``structures`` and ``triggers``) the items and their
    triggers. ``xgr`` is the xgrammar module of the caller (protocol imports none)."""
    tag = json.loads(spec)
    if "structures" not in tag:
        return (spec,)
    items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"]) for s in tag["structures"]]
    return items, tag["triggers"]
