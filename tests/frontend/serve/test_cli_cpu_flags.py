"""kvpool serve's CPU knobs for the worker (kvpool's own flags, not vLLM's): given, each
reaches the worker under its own name; not given, the worker keeps its defaults; out of
range, serve refuses before starting anything. The worker always learns the launcher's
pid, whose children are the serve's own processes (worker/cpu/host_load.py)."""

from __future__ import annotations

import os

import pytest

from frontend.serve.cli import parse_serve
from frontend.serve.launcher import Launcher
from worker.__main__ import config_from_args


def worker_argv(argv: list[str]) -> list[str]:
    la = Launcher(parse_serve(["serve", "m", *argv]), log=lambda *a, **k: None)
    la.build()
    return la.children["worker"].argv


def value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_the_cpu_knobs_reach_the_worker_as_given():
    w = worker_argv(["--cpu-wide-step-tokens", "0", "--cpu-nice", "0"])
    assert value(w, "--cpu-wide-step-tokens") == "0" and value(w, "--cpu-nice") == "0"
    config = config_from_args(w[3:] + ["--device", "cpu"])
    assert config.cpu_wide_step_tokens == 0 and config.cpu_nice == 0


def test_not_given_the_worker_keeps_its_own_defaults():
    w = worker_argv([])
    assert "--cpu-wide-step-tokens" not in w and "--cpu-nice" not in w


def test_the_worker_is_told_the_launchers_pid():
    w = worker_argv([])
    assert value(w, "--serve-pid") == str(os.getpid())  # the launcher builds the argv in its own process
    assert config_from_args(w[3:] + ["--device", "cpu"]).serve_pid == os.getpid()


@pytest.mark.parametrize(("argv", "message"), [
    (["--cpu-nice", "20"], "--cpu-nice must be 0..19"),
    (["--cpu-nice", "-1"], "--cpu-nice must be 0..19"),
    (["--cpu-wide-step-tokens", "-1"], "--cpu-wide-step-tokens must be >= 0"),
])
def test_a_value_the_worker_would_refuse_is_refused_before_anything_starts(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse_serve(["serve", "m", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err
