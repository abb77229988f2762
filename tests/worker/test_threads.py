"""The worker leaves a core to the scheduler unless OMP_NUM_THREADS is given, takes it
back for a big step (``--cpu-wide-step-tokens``), and runs at a lower priority on CPU
(``--cpu-nice``), its torch threads too."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from worker.threads import StepThreads, default_num_threads, wide_num_threads

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("env", "cpus", "expected"), [
    ({}, 2, 1), ({}, 16, 15), ({}, 1, 1), ({}, None, 1),
    ({"OMP_NUM_THREADS": "2"}, 2, None), ({"OMP_NUM_THREADS": ""}, 4, 3),
])  # fmt: skip
def test_one_core_fewer_than_the_machine_unless_told(env, cpus, expected):
    assert default_num_threads(env, cpus) == expected


def test_the_worker_and_the_threads_torch_starts_after_run_at_the_nice_asked():
    # As worker.startup does it: torch imported first, the priority lowered, then the
    # threads set and a parallel op run. Every thread of the process must be at nice 5.
    code = textwrap.dedent("""
        import os
        import torch
        from worker.threads import lower_cpu_priority
        before = os.getpriority(os.PRIO_PROCESS, 0)
        print(lower_cpu_priority(before + 5), lower_cpu_priority(before + 2))
        torch.set_num_threads(2)
        torch.ones(4096, 4096).sum()
        # Field 19 of /proc/self/task/TID/stat is the thread's nice value.
        tasks = "/proc/self/task"
        nices = [open(f"{tasks}/{tid}/stat").read().rsplit(")", 1)[1].split()[16] for tid in os.listdir(tasks)]
        print(before, *nices)
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    first, second = r.stdout.split("\n")[:2]
    before, *threads = map(int, second.split())
    assert first.split() == [str(before + 5)] * 2  # never raised back by a smaller value
    assert len(threads) >= 2 and set(threads) == {before + 5}


@pytest.mark.parametrize("nice", ["-1", "20"])
def test_a_nice_outside_0_to_19_is_refused(nice):
    r = subprocess.run([sys.executable, "-m", "worker", "--cpu-nice", nice], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--cpu-nice must be 0..19" in r.stderr


@pytest.mark.parametrize(("env", "cpus", "tp", "expected"), [
    ({}, 2, 1, 2), ({}, 16, 1, 16), ({}, None, 1, 1),
    ({"OMP_NUM_THREADS": "1"}, 2, 1, None), ({}, 4, 2, None),
])  # fmt: skip
def test_a_big_step_takes_every_core_unless_told_the_count_or_ranks_share_them(env, cpus, tp, expected):
    assert wide_num_threads(env, cpus, tp) == expected


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_a_step_of_at_least_min_tokens_runs_wide_and_the_count_comes_back(one_thread):
    threads = StepThreads(wide=3, min_tokens=128)
    seen = {}
    for n in (1, 127, 128, 2048):
        with threads.step(n):
            seen[n] = torch.get_num_threads()
        assert torch.get_num_threads() == 1
    assert seen == {1: 1, 127: 1, 128: 3, 2048: 3}
    with pytest.raises(RuntimeError, match="boom"), threads.step(500):
        raise RuntimeError("boom")  # a failing forward restores the count too
    assert torch.get_num_threads() == 1
    for off in (StepThreads(None, 128), StepThreads(3, 0)):
        with off.step(4096):
            assert torch.get_num_threads() == 1


def test_a_negative_wide_step_is_refused():
    r = subprocess.run([sys.executable, "-m", "worker", "--cpu-wide-step-tokens", "-1"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)  # fmt: skip
    assert r.returncode == 2 and "--cpu-wide-step-tokens must be >= 0" in r.stderr
