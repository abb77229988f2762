"""The host-load check (worker/cpu/host_load.py) on /proc samples fed by hand: what counts as
busy, what counts as this serve's own, and the hysteresis that keeps big steps narrow at
once beside a neighbour and lets them go wide again only after it has stayed away; then
the real check beside a real busy process."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from worker.cpu.host_load import HostLoad, NeighbourLoad, cpu_ticks, process_ticks
from worker.cpu.threads import StepThreads

# user nice system idle iowait irq softirq steal guest guest_nice
STAT = """cpu  300 10 60 500 20 0 5 7 40 0
cpu0 100 10 20 300 10 0 5 3 40 0
cpu1 200 0 40 200 10 0 0 4 0 0
intr 1 2 3
ctxt 99
"""


def test_busy_is_user_nice_system_irq_softirq_of_the_cpus_asked():
    # cpu0: busy 100+10+20+0+5 = 135 of 100+10+20+300+10+0+5+3 = 448 (guest is inside user)
    assert cpu_ticks(STAT, {0}) == (135, 448, 1)
    # cpu1: busy 240 of 454; the aggregate "cpu " line is never counted twice
    assert cpu_ticks(STAT, None) == (135 + 240, 448 + 454, 2)
    assert cpu_ticks(STAT, {0, 1, 7}) == (375, 902, 2)


def test_a_processs_ticks_are_its_utime_and_stime_whatever_its_name():
    # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime cutime ...
    stat = "4242 (python -m (worker)) S 1 4242 4242 0 -1 4194560 10 0 0 0 1234 56 900 800 20 0 3 0\n"
    assert process_ticks(stat) == 1234 + 56


def test_narrow_at_once_beside_a_neighbour_wide_after_settle_quiet_looks():
    d = NeighbourLoad(busy_cores=0.5, free_cores=0.3, settle=2)
    assert d.free
    assert d.observe(0.1) and d.observe(0.45)  # in between: no change
    assert not d.observe(0.5)  # a core's worth: narrow at once
    assert not d.observe(0.1)  # one quiet look is not enough
    assert not d.observe(0.4)  # in between: the count starts again
    assert not d.observe(0.2)
    assert d.observe(0.0)  # two quiet looks in a row
    assert d.others_cores == 0.0
    assert not d.observe(0.9)


def _proc_stat(busy: int, idle: int) -> str:
    # two CPUs, the ticks split evenly; busy all user
    return "".join(f"cpu{i} {busy // 2} 0 0 {idle // 2} 0 0 0 0 0 0\n" for i in range(2))


def _pid_stat(pid: int, ticks: int) -> str:
    return f"{pid} (x) S 1 1 1 0 -1 0 0 0 0 0 {ticks} 0 0 0 20 0 1 0\n"


class FakeProc:
    """A /proc of text files written by the test: the CPUs, this process, the serve's launcher
    (this test's parent) and its children."""

    def __init__(self, root):
        self.root = root
        self.me, self.serve = os.getpid(), os.getppid()

    def write(self, busy: int, idle: int, ticks: dict[int, int], children: list[int]) -> None:
        (self.root / "stat").write_text(_proc_stat(busy, idle))
        for pid, t in ticks.items():
            (self.root / str(pid)).mkdir(exist_ok=True)
            (self.root / str(pid) / "stat").write_text(_pid_stat(pid, t))
        task = self.root / str(self.serve) / "task" / str(self.serve)
        task.mkdir(parents=True, exist_ok=True)
        (task / "children").write_text(" ".join(map(str, children)) + " ")


@pytest.fixture
def proc(tmp_path):
    return FakeProc(tmp_path)


def _load(proc: FakeProc, serve_pid: int | None) -> HostLoad:
    load = HostLoad(serve_pid, interval_s=1.0, proc=str(proc.root))
    load.cpus = {0, 1}
    return load


def test_the_serves_own_processes_are_not_neighbours(proc):
    scheduler, frontend = 1_000_001, 1_000_002
    load = _load(proc, proc.serve)
    proc.write(0, 0, {proc.me: 0, proc.serve: 0, scheduler: 0, frontend: 0}, [proc.me, scheduler, frontend])
    assert load.allows_wide(0.0)  # the first look only sets the baseline
    # 1 s later: 200 ticks of 2 CPUs, 180 busy: the worker 100, the launcher 10, the
    # scheduler 30, the frontend 40 -> nobody else
    proc.write(180, 20, {proc.me: 100, proc.serve: 10, scheduler: 30, frontend: 40}, [proc.me, scheduler, frontend])
    assert load.allows_wide(1.0) and load.others_cores == 0.0
    # another 200 ticks, all busy: the serve's 100 (the worker 80, the scheduler and the
    # frontend 10 each) and a neighbour's whole core
    proc.write(380, 20, {proc.me: 180, proc.serve: 10, scheduler: 40, frontend: 50}, [proc.me, scheduler, frontend])
    assert not load.allows_wide(2.0)
    assert load.others_cores == pytest.approx(1.0)


def test_without_the_serves_pid_its_other_processes_count_as_neighbours(proc):
    scheduler = 1_000_001
    load = _load(proc, None)
    proc.write(0, 0, {proc.me: 0, scheduler: 0}, [proc.me, scheduler])
    load.allows_wide(0.0)
    proc.write(160, 40, {proc.me: 100, scheduler: 60}, [proc.me, scheduler])
    assert not load.allows_wide(1.0)
    assert load.others_cores == pytest.approx(0.6)


def test_a_pid_that_is_not_this_workers_parent_is_not_taken_as_the_serve(proc):
    assert HostLoad(proc.serve + 1, proc=str(proc.root)).serve_pid is None
    assert HostLoad(proc.serve, proc=str(proc.root)).serve_pid == proc.serve


def test_a_process_seen_first_counts_from_the_next_look(proc):
    scheduler, late = 1_000_001, 1_000_003
    load = _load(proc, proc.serve)
    proc.write(0, 0, {proc.me: 0, scheduler: 0}, [proc.me, scheduler])
    load.allows_wide(0.0)
    # a new child of the launcher appears with 500 ticks of its past: none of them ours
    # this look (its 50 ticks of this second count as others'), all of the next look's
    proc.write(150, 50, {proc.me: 100, scheduler: 0, late: 500}, [proc.me, scheduler, late])
    load.allows_wide(1.0)
    assert load.others_cores == pytest.approx(0.5)
    proc.write(300, 100, {proc.me: 200, scheduler: 0, late: 550}, [proc.me, scheduler, late])
    load.allows_wide(2.0)
    assert load.others_cores == 0.0


def test_the_host_is_looked_at_once_an_interval_and_an_unreadable_proc_changes_nothing(proc):
    load = _load(proc, None)
    proc.write(0, 0, {proc.me: 0}, [])
    load.allows_wide(0.0)
    proc.write(200, 0, {proc.me: 0}, [])  # two busy cores, none of them this worker's
    assert load.allows_wide(0.5)  # not looked again yet
    assert not load.allows_wide(1.0)
    (proc.root / "stat").unlink()
    assert not load.allows_wide(5.0)


def _width(threads: StepThreads) -> int:
    with threads.step(1):
        return torch.get_num_threads()


def _until(threads: StepThreads, width: int, timeout_s: float) -> bool:
    """Run steps until one runs at ``width`` threads; False after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _width(threads) == width:
            return True
        time.sleep(0.05)
    return False


def test_big_steps_stay_narrow_beside_a_busy_process_and_go_wide_after_it_stops(one_thread):
    # The real sampler, this process as the worker; the neighbour spins on one core at nice 0.
    threads = StepThreads(2, 1, None, HostLoad(interval_s=0.25))
    if not _until(threads, 2, 15):
        pytest.skip(f"this host's other processes keep {threads.load.others_cores:.1f} cores busy")
    cpu = max(os.sched_getaffinity(0))
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
    try:
        assert _until(threads, 1, 10), "a step went wide for 10 s beside the busy process"
        # then never wide while it runs: a dozen looks
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            assert _width(threads) == 1, f"a step went wide beside the busy process ({threads.load.others_cores:.2f} cores)"
            assert not threads.wide_allowed
            time.sleep(0.05)
        assert threads.load.others_cores >= 0.5
    finally:
        busy.kill()
        busy.wait(timeout=10)
    if not _until(threads, 2, 20):
        others = threads.load.others_cores
        assert others >= threads.load.decision.free_cores, f"no wide step 20 s after the busy process stopped ({others:.2f} cores)"
        pytest.skip(f"the host's other processes kept {others:.1f} cores busy after the busy process stopped")
    assert threads.wide_allowed and threads.num_wide_steps >= 2
