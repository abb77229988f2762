"""The table of ``vllm serve``'s flags (vLLM 0.32), grouped as ``vllm serve --help``
groups them, with kvpool's answer to each (see ``rules``): handled, passed to a child,
the same behaviour already, or refused with the reason.

``GROUPS`` is the table, in vLLM's order; ``frontend.serve.cli`` builds ``kvpool serve``'s
parser from it and docs/vllm-serve-flags.md is written from it
(``python -m frontend.serve.flags.doc``). A handled flag that reaches a child is a row of
the settings table (``protocol.serve_flags``), declared there once; a passed flag's type,
default and help are its child's."""

from __future__ import annotations

from frontend.serve.flags import (
    cache,
    engine,
    features,
    frontend_args,
    model,
    options,
    parallel,
    scheduling,
)
from frontend.serve.flags.rules import Group, Rule

GROUPS: list[Group] = [
    *options.GROUPS, *frontend_args.GROUPS, *model.GROUPS, *parallel.GROUPS, *cache.GROUPS,
    *features.GROUPS,
    *scheduling.GROUPS, *engine.GROUPS,
]



def all_rules() -> list[Rule]:
    return [rule for group in GROUPS for rule in group.rules]


def rule_for(flag: str) -> Rule:
    return next(r for r in all_rules() if flag in r.option_strings)
