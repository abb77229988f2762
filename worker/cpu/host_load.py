"""Whether processes other than this serve's keep the host's cores busy, so that a worker
takes the spare core for its big steps (worker/cpu/threads.py `StepThreads`) only while that
core is free.

Why: a big step runs one OpenMP thread per core, and each op of its forward waits for the
slowest. A neighbour that keeps a core busy (a benchmark client's timing loop, a build, a
busy loop at nice 0) holds the core one of them lands on, and at nice 5 that thread gets
a fraction of it: every op waits for it, and the worker ran many times slower than with
every step narrow (issue #45; docs/benchmarks.md has the figures).

How: every ``interval_s`` at most, a look at /proc (on the step path, but once an interval:
a few small reads):

* /proc/stat: the busy ticks of the CPUs this process may run on (user, nice, system,
  irq, softirq; guest time is inside user), and all their ticks;
* /proc/self/stat: this worker's own ticks (utime + stime, every thread of it);
* with ``serve_pid`` (``kvpool serve`` passes its own pid, ``--serve-pid``): the
  launcher's ticks and its other children's, the scheduler's and the frontend's. Theirs is
  the use the spare core was left for, which the wide steps were measured beside, not a
  neighbour's. A process seen for the first time counts from the next look on.

The rest, divided by the ticks of one CPU, is the others' use in cores. `NeighbourLoad`
decides from it, with hysteresis: narrow at once when a look finds others using
``busy_cores`` or more (a neighbour holding a core measures about 1 while the worker is
narrow, and most of a core while it is wide, since it runs at nice 0 against the
worker's 5); wide again only after ``settle`` looks in a row under ``free_cores``. A late
narrow step costs little; a wide step beside a neighbour costs several times its time.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 0.5
# NOTE: in cores' worth of CPU time used by processes other than this serve's. Between what
# a benchmark client's streaming loop and the kernel use beside a serve, and what a
# process that keeps a core busy shows even while the worker's wide step shares its core.
DEFAULT_BUSY_CORES = 0.5
DEFAULT_FREE_CORES = 0.3
DEFAULT_SETTLE = 2

# /proc/stat's cpu fields, in order; guest and guest_nice are already inside user and nice.
_BUSY_FIELDS = (0, 1, 2, 5, 6)  # user, nice, system, irq, softirq
_ALL_FIELDS = 8  # ... idle (3), iowait (4), steal (7)


def cpu_ticks(proc_stat: str, cpus: set[int] | None) -> tuple[int, int, int]:
    """(busy ticks, all ticks, CPUs counted) of the ``cpuN`` lines of /proc/stat whose N is
    in ``cpus`` (None: every one)."""
    busy = total = n = 0
    for line in proc_stat.splitlines():
        if not line.startswith("cpu") or line.startswith("cpu "):
            continue
        name, *fields = line.split()
        if cpus is not None and int(name[3:]) not in cpus:
            continue
        values = [int(v) for v in fields[:_ALL_FIELDS]]
        busy += sum(values[i] for i in _BUSY_FIELDS if i < len(values))
        total += sum(values)
        n += 1
    return busy, total, n


def process_ticks(pid_stat: str) -> int:
    """utime + stime of one /proc/PID/stat (every thread of the process)."""
    # NOTE: the command name (field 2) may hold spaces and parentheses: split after its last ")".
    fields = pid_stat.rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # fields 14 and 15, counted from 1 before the name


@dataclass(slots=True)
class NeighbourLoad:
    """Whether big steps may go wide, from the others' use in cores at each look."""

    busy_cores: float = DEFAULT_BUSY_CORES
    free_cores: float = DEFAULT_FREE_CORES
    settle: int = DEFAULT_SETTLE
    free: bool = True
    others_cores: float = 0.0
    _quiet_looks: int = 0

    def observe(self, others_cores: float) -> bool:
        """Take one look's figure; whether big steps may go wide now."""
        self.others_cores = others_cores
        if others_cores >= self.busy_cores:
            self._quiet_looks = 0
            self.free = False
        elif others_cores < self.free_cores:
            self._quiet_looks += 1
            if self._quiet_looks >= self.settle:
                self.free = True
        else:
            self._quiet_looks = 0
        return self.free


class HostLoad:
    """The CPU use of processes other than this serve's, looked at every ``interval_s`` at
    most, and whether it leaves the spare core free; see the module doc."""

    def __init__(self, serve_pid: int | None = None, interval_s: float = DEFAULT_INTERVAL_S,
                 decision: NeighbourLoad | None = None, proc: str = "/proc"):
        self.proc = proc
        self.interval_s = interval_s
        self.decision = decision or NeighbourLoad()
        # NOTE: only while it is this worker's parent: a pid reused by another process is not ours.
        self.serve_pid = serve_pid if serve_pid is not None and serve_pid == os.getppid() else None
        self.cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        self._checked = -math.inf
        self._last: tuple[int, int] | None = None  # busy and all ticks at the last look
        self._ours: dict[int, int] = {}  # pid -> ticks at the last look

    @property
    def free(self) -> bool:
        return self.decision.free

    @property
    def others_cores(self) -> float:
        return self.decision.others_cores

    def allows_wide(self, now: float) -> bool:
        """The cores a big step would take are free, as of the last look (at most
        ``interval_s`` before ``now``, a monotonic time)."""
        if now - self._checked >= self.interval_s:
            self._checked = now
            try:
                self._look()
            except (OSError, ValueError, IndexError) as e:
                log.debug("cannot read the host's CPU use: %s", e)
        return self.decision.free

    def _look(self) -> None:
        with open(f"{self.proc}/stat") as f:
            busy, total, n = cpu_ticks(f.read(), self.cpus)
        ours = self._ours_ticks()
        last, self._last = self._last, (busy, total)
        if last is None or n == 0 or total <= last[1]:
            return
        others = max(0, busy - last[0] - ours) / ((total - last[1]) / n)
        was = self.decision.free
        if self.decision.observe(others) != was:
            log.info("%.1f cores used besides this serve's: big steps %s", others,
                     "stay on the usual threads" if was else "take every core again")

    def _ours_ticks(self) -> int:
        """The ticks this process and, with ``serve_pid``, the serve's other processes used
        since the last look; a process seen for the first time counts from the next."""
        pids = {os.getpid()}
        if self.serve_pid is not None:
            pids |= {self.serve_pid, *self._children(self.serve_pid)}
        seen: dict[int, int] = {}
        for pid in pids:
            try:
                with open(f"{self.proc}/{pid}/stat") as f:
                    seen[pid] = process_ticks(f.read())
            except (FileNotFoundError, ProcessLookupError):
                continue  # ended meanwhile
        ticks = sum(t - self._ours.get(pid, t) for pid, t in seen.items())
        self._ours = seen
        return ticks

    def _children(self, pid: int) -> list[int]:
        out = []
        for tid in os.listdir(f"{self.proc}/{pid}/task"):
            try:
                with open(f"{self.proc}/{pid}/task/{tid}/children") as f:
                    out += [int(c) for c in f.read().split()]
            except FileNotFoundError:
                continue  # the thread ended meanwhile
        return out
