"""One row of the settings table: a ``vllm serve`` flag that reaches a child process,
declared once (its spellings, type, default, choices and help) with the processes it
goes to. Each process adds its rows to its own parser (``add_flag``); ``kvpool serve``
writes a row's settled value onto a child's command line (``flag_argv``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SCHEDULER, WORKER, FRONTEND = "scheduler", "worker", "frontend"
PROCESSES = (SCHEDULER, WORKER, FRONTEND)


@dataclass(frozen=True, slots=True)
class Flag:
    flags: tuple[str, ...]  # vLLM's spellings, the long one first
    to: tuple[str, ...]  # the processes whose parser declares it and whose argv kvpool serve writes it into
    kwargs: dict[str, Any] = field(default_factory=dict)  # add_argument's keywords
    # None: every value the parser takes is served; else only these (others: `why_not`).
    accepts: tuple[Any, ...] | None = None
    why_not: str = ""

    @property
    def name(self) -> str:
        return self.flags[0]

    @property
    def dest(self) -> str:
        return self.kwargs.get("dest") or self.name.removeprefix("--").replace("-", "_")

    @property
    def default(self) -> Any:
        return self.kwargs.get("default", False if self.kwargs.get("action") == "store_true" else None)


def flag(flags: str, *to: str, accepts: tuple | None = None, why_not: str = "", **kwargs: Any) -> Flag:
    assert to and set(to) <= set(PROCESSES), to
    return Flag(tuple(flags.split()), to, kwargs, accepts, why_not)


def add_flag(parser, row: Flag, dest: str | None = None) -> None:
    """Declare ``row`` on a process's parser (or argument group), under the process's own
    ``dest`` where its config names the setting otherwise."""
    parser.add_argument(*row.flags, **(row.kwargs | ({"dest": dest} if dest else {})))


def unaccepted(row: Flag, value: Any) -> str | None:
    """The line refusing ``value`` of ``row`` (one of vLLM's choices kvpool does not serve), or None."""
    if row.accepts is None or value in row.accepts:
        return None
    return f"{row.name} {value}: {row.why_not}"


def flag_argv(row: Flag, value: Any) -> list[str]:
    """``value`` on a child's command line; nothing for the row's default, which is the
    child's default too (the same row), nor for None (the child's to settle)."""
    if value is None or value == row.default:
        return []
    if value is True:
        return [row.name]
    if value is False:
        return [f"--no-{row.name[2:]}"]
    if isinstance(value, list | tuple):
        return [row.name, *map(str, value)]
    return [row.name, str(value)]
