"""How many CPU threads the worker's torch ops use, and at what priority.

torch takes every core by default; the worker shares the machine with the scheduler
(and the frontend), so its threads then fight them for the cores, and decoding slows
by several times (`make compare` shows it). vLLM's CPU backend binds one core fewer
than the machine has; so does the worker, unless OMP_NUM_THREADS says otherwise.

Big steps: a step whose projections are big enough runs its forward on every core, the
one left to the scheduler and frontend included. By default that is a step of at least
``WIDE_STEP_WEIGHT_TOKENS`` / (the model's projection weights) tokens (``wide_step_tokens``;
``--cpu-wide-step-tokens N`` sets N): the cost of going wide (a second thread woken at each
op, and sharing its core with the scheduler, frontend and client) is about the same for
every step, what it saves grows with the step's multiply-adds, and with the bytes it reads
from memory: a model of ``WIDE_STEP_MEMORY_WEIGHTS`` projection weights or more goes wide
at every step, one row's decode included, since each step reads all its weights from
memory and two cores stream memory faster than one. During a wave of prefills the
scheduler and frontend wait on the step, so the core would sit idle; at a decode step of a
model of tens of millions of parameters it is idle most of the step too.
docs/benchmarks.md ("2026-12-03, 15:45", "2026-12-03, 19:00" and "Figures moved from
docstrings (2026-12-07)") has the measurements.
Only a worker alone on its host goes wide (worker/cpu/host_peers.py): replicas sharing a host
share its cores, and two going wide spin on each other's. And only while no other process
keeps a core busy (worker/cpu/host_load.py, looked at every half second at most): the wide
step's extra thread lands on some core, each op of the forward waits for it, and beside
a neighbour that holds one (a benchmark client's timing loop, a busy loop at nice 0)
that thread gets a fraction of its core, so every step ran several times slower than
narrow (issue #45). The scheduler's and frontend's use is not a neighbour's (the core
was left for them, and the wide steps were measured beside them); a neighbour is
anything else that uses half a core or more. ``--cpu-wide-step-tokens 0`` turns wide
steps off; the worker's /metrics has ``kvpool_worker_wide_steps_total``,
``kvpool_worker_wide_steps_allowed`` and ``kvpool_worker_cpu_neighbour_cores``.

Priority: on CPU the worker runs at nice 5 (``--cpu-nice``). It shares the cores with the
scheduler and the frontend, which do little but must answer at once: a burst of requests
is tokenized and admitted while the worker computes. At equal priority the worker's
compute threads (OpenMP spins between ops) held them back, and at nice 5 requests are
answered sooner and the output throughput is higher (docs/benchmarks.md, "Figures moved
from code comments", worker/cpu/threads.py). When nothing else wants the cores, nice costs the
worker nothing.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from worker.cpu.host_load import HostLoad
from worker.cpu.host_peers import HostPeers


def default_num_threads(env: Mapping[str, str], cpu_count: int | None) -> int | None:
    """The thread count to set, or None to leave torch's own (OMP_NUM_THREADS given)."""
    if env.get("OMP_NUM_THREADS"):
        return None
    return max(1, (cpu_count or 1) - 1)


def wide_num_threads(env: Mapping[str, str], cpu_count: int | None, tensor_parallel_size: int = 1) -> int | None:
    """The thread count for a big step: every core, or None (no widening) when
    OMP_NUM_THREADS is given or tensor-parallel ranks share the cores."""
    if env.get("OMP_NUM_THREADS") or tensor_parallel_size > 1:
        return None
    return cpu_count or 1


DEFAULT_CPU_NICE = 5
# NOTE: tokens x projection weights from which a step runs wide by default: the tiny
# checkpoint's 3.1M weights from 128 tokens (a prefill wave; its decode steps of up to 64
# rows gained nothing measurable), llama50m's 51M from 8 (its decode steps too).
WIDE_STEP_WEIGHT_TOKENS = 384_000_000
# NOTE: projection weights from which every step runs wide: between the tiny checkpoint's
# 3M (cache-resident; its decode steps gained nothing) and llama50m's 50M, whose one-row
# decode steps gained, as SmolLM2's 106M did (docs/benchmarks.md, "2026-12-07, 06:00").
WIDE_STEP_MEMORY_WEIGHTS = 32_000_000


def wide_step_tokens(weights_per_token: int) -> int:
    """The default ``--cpu-wide-step-tokens`` of a model whose projections take this many
    multiply-adds a token (``projection_weights``)."""
    if weights_per_token >= WIDE_STEP_MEMORY_WEIGHTS:
        return 1
    return max(1, -(-WIDE_STEP_WEIGHT_TOKENS // max(1, weights_per_token)))


def projection_weights(hidden: int, intermediate: int, num_layers: int, q_size: int, kv_size: int) -> int:
    """The weights one token meets in a decoder's projections: each layer's q, k, v and o
    and its gated MLP (the vocabulary's projection is per sampled row, not per token)."""
    return num_layers * (hidden * (2 * q_size + 2 * kv_size) + 3 * hidden * intermediate)


class StepThreads:
    """torch's thread count per step: as set for most steps, ``wide`` for a step of at
    least ``min_tokens`` tokens (None or 0: never), while ``peers`` (worker/cpu/host_peers.py)
    says no other worker runs on this host and ``load`` (worker/cpu/host_load.py) says no
    other process keeps a core busy."""

    def __init__(self, wide: int | None, min_tokens: int, peers: HostPeers | None = None, load: HostLoad | None = None):
        self.wide = wide
        self.min_tokens = min_tokens
        self.peers = peers
        self.load = load
        self.num_wide_steps = 0

    def goes_wide(self, num_tokens: int, base: int) -> bool:
        """Whether a step of ``num_tokens`` runs on ``wide`` threads rather than ``base``."""
        if not self.wide or not self.min_tokens or num_tokens < self.min_tokens or self.wide <= base:
            return False
        now = time.monotonic()
        # NOTE: both looked at, so that each keeps its own view current.
        alone = self.peers is None or self.peers.alone(now)
        free = self.load is None or self.load.allows_wide(now)
        return alone and free

    @property
    def wide_allowed(self) -> bool:
        """Whether a big step would go wide now, as of the checks' last looks (no new look)."""
        alone = self.peers is None or self.peers.seen_alone
        return bool(self.wide and self.min_tokens) and alone and (self.load is None or self.load.free)

    @contextmanager
    def step(self, num_tokens: int) -> Iterator[None]:
        """Run the block at the step's thread count, and restore the count after."""
        import torch

        base = torch.get_num_threads()
        if not self.goes_wide(num_tokens, base):
            yield
            return
        torch.set_num_threads(self.wide)
        self.num_wide_steps += 1
        try:
            yield
        finally:
            torch.set_num_threads(base)


def lower_cpu_priority(nice: int) -> int:
    """Run every thread of this process at nice ``nice`` at least (none is raised back);
    the calling thread's nice after.

    NOTE: Linux keeps a nice value per thread, and a thread starts with its creator's; so
    each thread there is now is lowered (``import torch`` has started one already), and the
    OpenMP threads torch starts at its first parallel op inherit the caller's. "At least"
    keeps it idempotent: tensor-parallel ranks, started by rank 0 with the same flags,
    inherit rank 0's value and do not lower it again."""
    tasks = "/proc/self/task"
    tids = [int(t) for t in os.listdir(tasks)] if os.path.isdir(tasks) else [0]
    for tid in tids:
        try:
            if nice > os.getpriority(os.PRIO_PROCESS, tid):
                os.setpriority(os.PRIO_PROCESS, tid, nice)
        except ProcessLookupError:
            pass  # the thread ended meanwhile
    return os.getpriority(os.PRIO_PROCESS, 0)


def set_cpu_threads() -> int:
    """Apply the default to torch; return the count in force."""
    import torch

    n = default_num_threads(os.environ, os.cpu_count())
    if n is not None:
        torch.set_num_threads(n)
    return torch.get_num_threads()
