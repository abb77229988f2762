"""The worker's command line: its parser (``python -m worker --help``).

The settings ``kvpool serve`` gives the worker are the settings table's rows
(protocol/serve_flags/): declared there once, added here; the rest are the worker's
own (its scheduler link, ranks, CPU knobs, tiers' places)."""

from __future__ import annotations

import argparse
import re

from protocol.serve_flags import WORKER, rows_for
from protocol.serve_flags.flag import add_flag
from worker.config import CPU_DEFAULT_KV_CACHE_MEMORY, WorkerConfig
from worker.kv.kv_cache import parse_size


def memory_size(text: str) -> int:
    if text.strip().startswith("-"):
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: a memory size cannot be negative")
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# A value that starts like a negative number ("-4MiB", "-.5G"): argparse would take
# it for an option and say only "expected one argument".
_NEGATIVE_VALUE = re.compile(r"^-\.?\d")


def join_negative_values(argv: list[str]) -> list[str]:
    """``--flag -4MiB`` as ``--flag=-4MiB``, so the flag's own check names the problem."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and _NEGATIVE_VALUE.match(arg):
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def build_parser() -> argparse.ArgumentParser:
    d = WorkerConfig()
    p = argparse.ArgumentParser(prog="kvpool-worker", description="kvpool worker: owns the KV memory, executes the scheduler's step plans.")
    p.add_argument("--scheduler", default=d.scheduler, metavar="ENDPOINT",
                   help="the scheduler's worker port, a ZeroMQ endpoint (default %(default)s)")
    g = p.add_argument_group("kvpool serve's settings (protocol/serve_flags/)")
    for row in rows_for(WORKER):
        add_flag(g, row)
    p.add_argument("--disable-hybrid-kv-cache-manager", action=argparse.BooleanOptionalAction, default=d.disable_hybrid_kv_cache_manager,
                   help="one full-attention KV-cache group for a model mixing sliding-window and full layers, as vLLM: no "
                        "block is freed outside a window, but the layers still attend within theirs (default: off)")
    p.add_argument("--kv-cache-memory", type=memory_size, default=None, metavar="SIZE",
                   help=f"KV cache budget, e.g. 512MiB, 2GiB, 64M; at most what the device has available "
                        f"(default: on CPU {CPU_DEFAULT_KV_CACHE_MEMORY // 2**20}MiB, on CUDA see --gpu-memory-utilization)")
    p.add_argument("--http-port", type=int, default=d.http_port, help="/metrics and /health on 127.0.0.1 (default %(default)s; 0 disables)")
    p.add_argument("--scheduler-timeout", type=float, default=d.scheduler_timeout_s, metavar="SECONDS",
                   help="exit 3 (or reconnect) after this long without a message from the scheduler, or without "
                        "WorkerReady after hello; the scheduler's --worker-timeout is the same (default %(default)s)")
    p.add_argument("--reconnect", action="store_true",
                   help="on scheduler timeout, drop every row and handshake again instead of exiting (default: off)")
    p.add_argument("--curve-client-key", metavar="FILE", help="CURVE: this worker's secret certificate (NAME.key_secret) (default: no CURVE)")
    p.add_argument("--curve-server-key", metavar="FILE", help="CURVE: the scheduler's public certificate (NAME.key) (default: no CURVE)")
    _add_parallel_and_cpu_flags(p, d)
    return p


def _add_parallel_and_cpu_flags(p: argparse.ArgumentParser, d: WorkerConfig) -> None:
    """Tensor parallelism's ranks (their number: the table's row), and the kvpool serve that started the worker."""
    p.add_argument("--rank", type=int, default=None,
                   help="this process's rank, when each rank is started by hand (several hosts; needs --distributed-init-method) "
                        "(default: rank 0, starting the others on this host)")
    p.add_argument("--distributed-init-method", default=None, metavar="tcp://HOST:PORT",
                   help="rank 0's address for the group's TCP store (default: a free loopback port)")
    p.add_argument("--distributed-timeout", type=float, default=d.distributed_timeout_s, metavar="SECONDS",
                   help="how long a collective or the start-up rendezvous waits for another rank (default %(default)s)")
    p.add_argument("--serve-pid", type=int, default=None, metavar="PID",
                   help="the kvpool serve that started this worker (it passes its pid): its CPU use and its other "
                        "children's are the serve's own, not a neighbour's (default: none)")
