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


def _external(c: ServeConfig, child: str) -> list[str]:
    """The external tier's own flags (--kv-offloading-backend disk or mooncake): the worker
    holds the directory or the store's client, the scheduler asks the master too."""
    if c.kv_offloading_backend == "mooncake":
        return ["--mooncake-master", c.mooncake_master, "--mooncake-metadata", c.mooncake_metadata]
    if c.kv_offloading_backend == "disk" and child == "worker":
        return ["--kv-offloading-path", c.kv_offloading_path, "--kv-offloading-disk-size", f"{c.kv_offloading_disk_size:g}"]
    return []


def _given(*pairs: tuple[str, object]) -> list[str]:
    """``flag value`` for each pair whose value is not None."""
    return [arg for flag, value in pairs if value is not None for arg in (flag, str(value))]


def scheduler_argv(c: ServeConfig, client_port: int, worker_port: int, sched_http: int) -> list[str]:
    sched = [sys.executable, "-m", "scheduler", "--host", "127.0.0.1", "--port", str(client_port), "--worker-port", str(worker_port),
             "--http-port", str(sched_http), "--worker-reconnect-timeout", str(c.worker_restart_timeout)]
    sched += table_flags(c, "scheduler")
    if c.kv_eviction_policy != "lru":
        sched += ["--kv-eviction-policy", c.kv_eviction_policy]
    if c.max_pinned_fraction != 0.5:
        sched += ["--max-pinned-fraction", f"{c.max_pinned_fraction!r}"]
    sched += _given(("--prefix-caching-hash-algo", c.prefix_caching_hash_algo))
    sched += ["--dev-mode"] if c.dev_mode else []
    sched += _external(c, "scheduler")
    sched += _given(("--kv-events-endpoint", c.kv_events_endpoint or None),
                    ("--kv-events-replay-endpoint", c.kv_events_replay_endpoint or None), ("--kv-events-topic", c.kv_events_topic or None))
    return sched + list(c.kv_events_flags) + passed_flags(c, "scheduler") + list(c.scheduler_args)


def worker_argv(c: ServeConfig, worker_port: int, worker_http: int) -> list[str]:
    # NOTE: --reconnect: a scheduler that died is restarted; the worker handshakes with the next one.
    worker = [sys.executable, "-m", "worker", "--scheduler", f"tcp://127.0.0.1:{worker_port}", "--reconnect",
              "--http-port", str(worker_http)]
    worker += table_flags(c, "worker")
    worker += _given(("--device", c.device or None))
    if c.kv_cache_memory:
        worker += ["--kv-cache-memory", c.kv_cache_memory]
    elif c.kv_cache_memory_bytes:
        worker += ["--kv-cache-memory", str(c.kv_cache_memory_bytes)]
    worker += _external(c, "worker")
    if c.distributed_timeout_seconds is not None:
        worker += ["--distributed-timeout", f"{c.distributed_timeout_seconds:g}"]
    worker += _given(("--cpu-nice", c.cpu_nice), ("--cpu-wide-step-tokens", c.cpu_wide_step_tokens))
    # NOTE: the launcher builds the argv: the worker's parent, whose CPU use and other
    # children's (scheduler, frontend) are not a neighbour's (worker/host_load.py).
    worker += ["--serve-pid", str(os.getpid())]
    return worker + passed_flags(c, "worker") + list(c.worker_args)


def frontend_argv(c: ServeConfig, client_port: int, scheduler_http: str) -> list[str]:
    front = [sys.executable, "-m", "frontend", "--host", c.host, "--port", str(c.port), "--scheduler", f"tcp://127.0.0.1:{client_port}",
             "--scheduler-http", scheduler_http, "--max-request-body-bytes", str(c.max_request_body_bytes),
             "--scheduler-restart-timeout", f"{c.worker_restart_timeout:g}"]
    front += table_flags(c, "frontend")
    front += ["--dev-mode"] if c.dev_mode else []
    return front + passed_flags(c, "frontend")
