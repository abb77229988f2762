"""The settings ``kvpool serve`` gives its children, each declared once.

A row (``flag.Flag``) names a ``vllm serve`` flag, how it parses (type, default,
choices, help) and the processes it goes to. Each child's parser
(scheduler/engine/args.py, worker/args.py, frontend/config.py) declares its process's
rows from here, and its config's defaults are the rows'. ``kvpool serve``'s table
(frontend/serve/flags/) either settles a row (``declared``) or passes it on as given
(``passed``), and writes each child's argv from the same rows
(frontend/serve/child_argv.py). kvpool's own settings that kvpool serve gives a child are
rows too (``kvpool``); flags only one process has stay in its own parser.

One file per concern: ``model``, ``cache``, ``engine`` (logs, metrics, JSON configs),
``scheduling`` (the policy and its budgets), ``http_server`` and ``serving`` (the API
server's), ``kvpool``."""

from __future__ import annotations

from protocol.serve_flags import cache, engine, http_server, kvpool, model, scheduling, serving
from protocol.serve_flags.flag import FRONTEND, SCHEDULER, WORKER, Flag

__all__ = ["FRONTEND", "ROWS", "VLLM_ROWS", "SCHEDULER", "WORKER", "Flag", "rows_for"]

# vllm serve's flags first, then kvpool's own.
VLLM_ROWS: tuple[Flag, ...] = (*model.ROWS, *cache.ROWS, *engine.ROWS, *scheduling.ROWS, *http_server.ROWS, *serving.ROWS)
ROWS: tuple[Flag, ...] = (*VLLM_ROWS, *kvpool.ROWS)


def rows_for(process: str) -> tuple[Flag, ...]:
    """The rows that go to ``process``, in the table's order."""
    return tuple(row for row in ROWS if process in row.to)
