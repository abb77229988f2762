"""One row of the table of ``vllm serve``'s flags: what kvpool does with the flag.

Four answers, each a constructor:

* ``handled``: kvpool acts on it. A flag that reaches a child is a row of the settings
  table (``protocol.serve_flags``, ``declared``): its type, default and help are the
  row's, and ``frontend.serve.child_argv`` writes it into the argv of the processes the
  row names. A flag only ``kvpool serve`` reads declares its own (``handled``).
* ``passed``: given to a child process under the same name, verbatim, when given
  (the child's own parser checks the value).
* ``same``: accepted, nothing to do: kvpool already behaves as vLLM does with the flag.
* ``refused``: kvpool cannot do it; given, ``kvpool serve`` exits 2 with one line
  naming the flag and why, before starting anything. ``accepts`` lists the values
  whose behaviour in vLLM is kvpool's anyway (e.g. ``--pipeline-parallel-size 1``).

Every flag not ``handled`` is parsed with vLLM's arity and ``argparse.SUPPRESS`` as
default, so ``vars(args)`` holds it only when it was given.
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from protocol.serve_flags.flag import Flag

SWITCH, BOOL, ONE, OPTIONAL, MANY = "switch", "bool", "one", "optional", "many"
HANDLED, PASSED, SAME, REFUSED = "handled", "passed", "same", "refused"
ARITIES = (SWITCH, BOOL, ONE, OPTIONAL, MANY)


@dataclass(frozen=True, slots=True)
class Rule:
    flags: tuple[str, ...]  # vLLM's option strings, the long one first (for BOOL without its --no- twin)
    arity: str
    verdict: str
    note: str  # handled/passed: where it goes; same: why nothing is needed; refused: why not
    accepts: tuple[Any, ...] | None = None  # None: every value; else only these (the rest refused, for `why_not`)
    why_not: str = ""
    kwargs: dict[str, Any] = field(default_factory=dict)  # handled: kvpool's add_argument keywords
    to: tuple[str, ...] = ()  # passed, or handled from the settings table: the children given the flag

    @property
    def name(self) -> str:
        return self.flags[0]

    @property
    def dest(self) -> str:
        return self.kwargs.get("dest") or self.name.removeprefix("--").replace("-", "_")

    @property
    def option_strings(self) -> tuple[str, ...]:
        """Every spelling argparse accepts, as ``vllm serve --help`` lists them."""
        longs = [f for f in self.flags if f.startswith("--")]
        if self.arity != BOOL:
            return self.flags
        return (*longs, *(f"--no-{f[2:]}" for f in longs), *(f for f in self.flags if not f.startswith("--")))

    def help(self) -> str:
        if self.verdict == HANDLED:
            return self.kwargs.get("help", "") or self.note
        if self.verdict == PASSED:
            return f"passed to the {' and '.join(self.to)}, as given"
        if self.verdict == SAME:
            return f"accepted, as vLLM: {self.note}"
        allowed = f" (accepted: {', '.join(spell(self, v) for v in self.accepts)})" if self.accepts else ""
        return f"not supported: {self.note}{allowed}"


@dataclass(frozen=True, slots=True)
class Group:
    """One of vLLM's --help groups (its title and first line), with its rows."""

    title: str
    description: str
    rules: list[Rule]


def _flags(text: str) -> tuple[str, ...]:
    return tuple(text.split())


def handled(flags: str, arity: str, to: str, accepts: tuple | None = None, why_not: str = "", **kwargs) -> Rule:
    return Rule(_flags(flags), arity, HANDLED, to, accepts, why_not, kwargs)


def declared(row: Flag, arity: str, note: str, dest: str | None = None) -> Rule:
    """A handled flag from the settings table: the row's declaration, for kvpool serve's
    parser too (under ``dest`` where kvpool serve reads it otherwise)."""
    kwargs = row.kwargs | ({"dest": dest} if dest else {})
    return Rule(row.flags, arity, HANDLED, note, row.accepts, row.why_not, kwargs, row.to)


def passed(flags: str, arity: str, *to: str, default_on: bool = False) -> Rule:
    """``default_on``: a BOOL flag on by default, so that its ``--no-`` form is passed too."""
    kwargs = {"default_on": True} if default_on else {}
    return Rule(_flags(flags), arity, PASSED, f"passed to the {' and '.join(to)}", kwargs=kwargs, to=to)


def same(flags: str, arity: str, why: str, type: Callable[[str], Any] | None = None) -> Rule:
    """``type``: the value check vLLM makes of it, made here too (else any value)."""
    return Rule(_flags(flags), arity, SAME, why, kwargs={"type": type} if type else {})


def refused(flags: str, arity: str, why: str, accepts: tuple = ()) -> Rule:
    return Rule(_flags(flags), arity, REFUSED, why, accepts, why)


def parse_kwargs(rule: Rule) -> dict[str, Any]:
    """add_argument keywords of a flag kvpool only parses (vLLM's arity, absent unless given)."""
    if rule.verdict == HANDLED:
        return dict(rule.kwargs)
    kw: dict[str, Any] = {"default": argparse.SUPPRESS, "dest": rule.dest, "help": rule.help()}
    if rule.verdict == SAME and "type" in rule.kwargs:
        kw["type"] = rule.kwargs["type"]
    if rule.arity == SWITCH:
        return kw | {"action": "store_true"}
    if rule.arity == BOOL:
        return kw | {"action": argparse.BooleanOptionalAction}
    metavar = rule.dest.upper()
    if rule.arity == OPTIONAL:
        return kw | {"nargs": "?", "const": "", "metavar": metavar}
    if rule.arity == MANY:
        return kw | {"nargs": "+", "metavar": metavar}
    return kw | {"metavar": metavar}


def add_rule(group, rule: Rule) -> None:
    flags = rule.flags if rule.arity == BOOL else rule.option_strings
    group.add_argument(*flags, **parse_kwargs(rule))


SHOWN_CHARS = 60


def _shown(value: Any) -> str:
    """A value as one short line: whitespace runs as one space, a long one cut."""
    text = " ".join(str(value).split())
    return shlex.quote(text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "...")


def spell(rule: Rule, value: Any) -> str:
    """``value`` as it is written on a command line, the flag first (on one line)."""
    if value is True:
        return rule.name
    if value is False:
        return f"--no-{rule.name[2:]}"
    if isinstance(value, list | tuple):
        return " ".join([rule.name, *map(_shown, value)])
    return f"{rule.name} {_shown(value)}" if value != "" else rule.name


def refusal(rule: Rule, args: argparse.Namespace) -> str | None:
    """The one line that refuses this flag as given, or None."""
    given = vars(args)
    if rule.dest not in given or rule.accepts is None or given[rule.dest] in rule.accepts:
        return None
    if rule.verdict == HANDLED and given[rule.dest] is None:
        return None  # a handled flag left at its default
    return f"kvpool serve: {spell(rule, given[rule.dest])}: {rule.why_not}"


def forwarded(rule: Rule, given: dict[str, Any]) -> list[str]:
    """The flag as given (``given``: dest -> value), for a child (``--no-X`` only where
    vLLM's default is on)."""
    if rule.dest not in given:
        return []
    value = given[rule.dest]
    if rule.arity == BOOL and value is False and not rule.kwargs.get("default_on"):
        return []  # the child's default: off
    if rule.arity in (SWITCH, BOOL) or value == "":
        return [spell(rule, value)]
    return [rule.name, *(map(str, value))] if isinstance(value, list) else [rule.name, str(value)]
