"""`python -m bench`: a benchmark reports. A figure below its target is marked in the
table and the run still exits 0; a crashed suite exits 1 after the others' figures;
--help and a misspelt suite name answer in words, not with a traceback."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

import bench.__main__ as bench_main
from bench.table import Row


def _fake_suite(monkeypatch, name: str, rows) -> None:
    mod = types.ModuleType(f"bench.{name}_bench")
    mod.rows = rows
    monkeypatch.setitem(sys.modules, f"bench.{name}_bench", mod)
    monkeypatch.setattr(bench_main, "SUITES", [*bench_main.SUITES, f"{name}_bench"])
    monkeypatch.setattr(bench_main, "NAMES", [*bench_main.NAMES, name])


def test_a_missed_target_is_marked_and_exits_zero(monkeypatch, capsys):
    _fake_suite(monkeypatch, "fake", lambda: [Row("slow thing", 2.0, "ms", "<= 1 ms", False), Row("fast thing", 0.5, "ms", "<= 1 ms", True)])
    assert bench_main.main(["fake"]) == 0
    out = capsys.readouterr().out
    assert "slow thing" in out and "NO" in out
    assert "1 of 2 figures with a target met; 1 marked NO" in out


def test_a_crashed_suite_exits_one_after_the_others_figures(monkeypatch, capsys):
    def boom():
        raise RuntimeError("the suite broke")

    _fake_suite(monkeypatch, "good", lambda: [Row("good thing", 1.0, "ms")])
    _fake_suite(monkeypatch, "bad", boom)
    assert bench_main.main(["good", "bad"]) == 1
    captured = capsys.readouterr()
    assert "good thing" in captured.out and "crashed: bad" in captured.out
    assert "RuntimeError: the suite broke" in captured.err


@pytest.mark.parametrize("argv", [["--help"], ["-h"]])
def test_help_lists_the_suites(argv):
    out = subprocess.run([sys.executable, "-m", "bench", *argv], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "usage: python -m bench" in out.stdout
    for name in ("pool", "scheduler", "offload_store", "tp"):
        assert name in out.stdout


def test_a_misspelt_suite_is_named_and_nothing_runs():
    out = subprocess.run([sys.executable, "-m", "bench", "pool", "shceduler"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "unknown suite 'shceduler'" in out.stderr and "pool, scheduler" in out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""
