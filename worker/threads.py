"""How many CPU threads the worker's torch ops use.

torch takes every core by default; the worker shares the machine with the scheduler
(and the frontend), so its threads then fight them for the cores: on 2 cores the
tiny checkpoint decoded 23-65 tok/s with torch's default and 400-526 with one thread
(`make compare`). vLLM's CPU backend binds one core fewer than the machine has; so
does the worker, unless OMP_NUM_THREADS says otherwise.
"""

from __future__ import annotations

import os
from collections.abc import Mapping


def default_num_threads(env: Mapping[str, str], cpu_count: int | None) -> int | None:
    """The thread count to set, or None to leave torch's own (OMP_NUM_THREADS given)."""
    if env.get("OMP_NUM_THREADS"):
        return None
    return max(1, (cpu_count or 1) - 1)


def set_cpu_threads() -> int:
    """Apply the default to torch; return the count in force."""
    import torch

    n = default_num_threads(os.environ, os.cpu_count())
    if n is not None:
        torch.set_num_threads(n)
    return torch.get_num_threads()
