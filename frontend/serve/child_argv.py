"""What ``kvpool serve`` gives each child process: its argv, from the settled config
(``frontend.serve.cli.parse_serve``) and the internal ports chosen free.

A setting of the settings table (protocol/serve_flags/) goes to the processes its row
names, spelled by the row (``table_flags``); flags the ``vllm serve`` table marks
``passed`` go to their child as given (``passed_flags``); the rest are kvpool serve's
own (ports, sockets, restarts) or one child's, written here."""

from __future__ import annotations

import os
import sys

from frontend.serve.config import ServeConfig
from frontend.serve.flags import all_rules
from frontend.serve.flags.rules import PASSED, forwarded
from protocol.serve_flags import rows_for
from protocol.serve_flags.flag import flag_argv


def table_flags(c: ServeConfig, child: str) -> list[str]:
    """The settings table's rows for ``child``, with their settled values."""
    values = {"model": str(c.model_dir)}  # NOTE: every child reads the folder (a GGUF file's, made by kvpool serve)
    return [arg for row in rows_for(child) for arg in flag_argv(row, values.get(row.dest, getattr(c, row.dest)))]


def passed_flags(c: ServeConfig, child: str) -> list[str]:
    """The ``passed`` flags given for ``child``, in the table's order."""
    return [arg for rule in all_rules() if rule.verdict == PASSED and child in rule.to for arg in forwarded(rule, c.given)]


def scheduler_argv(c: ServeConfig, client_port: int, worker_port: int, sched_http: int) -> list[str]:
    sched = [sys.executable, "-m", "scheduler", "--host", "127.0.0.1", "--port", str(client_port), "--worker-port", str(worker_port),
             "--http-port", str(sched_http), "--worker-reconnect-timeout", str(c.worker_restart_timeout)]
    sched += table_flags(c, "scheduler")
    return sched + list(c.kv_events_flags) + passed_flags(c, "scheduler") + list(c.scheduler_args)


def worker_argv(c: ServeConfig, worker_port: int, worker_http: int) -> list[str]:
    # NOTE: --reconnect: a scheduler that died is restarted; the worker handshakes with the next one.
    worker = [sys.executable, "-m", "worker", "--scheduler", f"tcp://127.0.0.1:{worker_port}", "--reconnect",
              "--http-port", str(worker_http)]
    worker += table_flags(c, "worker")
    if c.kv_cache_memory:
        worker += ["--kv-cache-memory", c.kv_cache_memory]
    elif c.kv_cache_memory_bytes:
        worker += ["--kv-cache-memory", str(c.kv_cache_memory_bytes)]
    if c.distributed_timeout_seconds is not None:
        worker += ["--distributed-timeout", f"{c.distributed_timeout_seconds:g}"]
    # NOTE: the launcher builds the argv: the worker's parent, whose CPU use and other
    # children's (scheduler, frontend) are not a neighbour's (worker/cpu/host_load.py).
    worker += ["--serve-pid", str(os.getpid())]
    return worker + passed_flags(c, "worker") + list(c.worker_args)


def frontend_argv(c: ServeConfig, client_port: int, scheduler_http: str) -> list[str]:
    front = [sys.executable, "-m", "frontend", "--host", c.host, "--port", str(c.port), "--scheduler", f"tcp://127.0.0.1:{client_port}",
             "--scheduler-http", scheduler_http, "--max-request-body-bytes", str(c.max_request_body_bytes),
             "--scheduler-restart-timeout", f"{c.worker_restart_timeout:g}"]
    front += table_flags(c, "frontend")
    return front + passed_flags(c, "frontend")
