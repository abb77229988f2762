"""The settings ``kvpool serve`` gives its children, each declared once.

A row (``flag.Flag``) names a ``vllm serve`` flag, how it parses (type, default,
choices, help) and the processes it goes to. ``kvpool serve``'s parser
(frontend/serve/flags/) and each child's (scheduler/engine/config.py,
worker/__main__.py, frontend/config.py) declare their process's rows from here, and
``kvpool serve`` writes each child's argv from the same rows
(frontend/serve/child_argv.py). kvpool's own settings that kvpool serve gives a child are
rows too (``kvpool``); flags only one process has stay in its own parser."""

from __future__ import annotations

from protocol.serve_flags import cache, engine, kvpool, model
from protocol.serve_flags.flag import FRONTEND, SCHEDULER, WORKER, Flag

__all__ = ["FRONTEND", "ROWS", "VLLM_ROWS", "SCHEDULER", "WORKER", "Flag", "rows_for"]

# vllm serve's flags first, then kvpool's own.
VLLM_ROWS: tuple[Flag, ...] = (*model.ROWS, *cache.ROWS, *engine.ROWS)
ROWS: tuple[Flag, ...] = (*VLLM_ROWS, *kvpool.ROWS)


def rows_for(process: str) -> tuple[Flag, ...]:
    """The rows that go to ``process``, in the table's order."""
    return tuple(row for row in ROWS if process in row.to)
