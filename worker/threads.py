"""How many CPU threads the worker's torch ops use, and at what priority.

torch takes every core by default; the worker shares the machine with the scheduler
(and the frontend), so its threads then fight them for the cores, and decoding slows
by several times (`make compare` shows it). vLLM's CPU backend binds one core fewer
than the machine has; so does the worker, unless OMP_NUM_THREADS says otherwise.

Priority: on CPU the worker runs at nice 5 (``--cpu-nice``). It shares the cores with the
scheduler and the frontend, which do little but must answer at once: a burst of requests
is tokenized and admitted while the worker computes. At equal priority the worker's
compute threads (OpenMP spins between ops) held them back: in alternated runs of
`prefix-c64` at nice 0 and at nice 5, TTFT was lower and output throughput higher at
nice 5 in most pairs. When nothing else wants the cores, nice costs the worker nothing.
"""

from __future__ import annotations

import os
from collections.abc import Mapping


def default_num_threads(env: Mapping[str, str], cpu_count: int | None) -> int | None:
    """The thread count to set, or None to leave torch's own (OMP_NUM_THREADS given)."""
    if env.get("OMP_NUM_THREADS"):
        return None
    return max(1, (cpu_count or 1) - 1)


DEFAULT_CPU_NICE = 5


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
