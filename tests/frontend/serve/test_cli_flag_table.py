"""Every flag of ``vllm serve`` 0.32 is in kvpool's table (frontend/serve/flags), with
vLLM's group, arity and spellings, and kvpool serve does what the table says: a
handled or passed flag changes a child's argv, a same flag changes nothing, a refused
one is refused by name with its reason (and its accepted values are accepted).

The list is tests/frontend/serve/data/vllm_serve_flags_0.32.txt, generated once from the
saved ``vllm serve --help=all`` by tests/frontend/serve/data/make_vllm_serve_flags.py (see its
docstring); nothing of kvpool's goes into it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from frontend.serve import launcher
from frontend.serve.cli import Refused, parse_serve
from frontend.serve.flags import GROUPS, all_rules, doc
from frontend.serve.flags.rules import (
    BOOL,
    HANDLED,
    MANY,
    ONE,
    OPTIONAL,
    PASSED,
    REFUSED,
    SAME,
    SWITCH,
    Rule,
)

REPO = Path(__file__).resolve().parents[3]
DATA = Path(__file__).parent / "data" / "vllm_serve_flags_0.32.txt"
VLLM = [line.split("\t") for line in DATA.read_text().splitlines() if not line.startswith("#")]

# A non-default value for each handled flag (the flags after "" change no child's argv).
HANDLED_SAMPLES = {
    "--disable-log-stats": [], "--enable-log-requests": [], "--host": ["0.0.0.0"], "--port": ["9000"],
    "--return-tokens-as-token-ids": [], "--dtype": ["half"], "--generation-config": ["vllm"], "--max-model-len": ["2k"],
    "--seed": ["7"], "--served-model-name": ["tiny"], "--distributed-timeout-seconds": ["20"],
    "--tensor-parallel-size": ["2"], "--block-size": ["32"], "--enable-prefix-caching": "--no-enable-prefix-caching",
    "--gpu-memory-utilization": ["0.5"], "--kv-cache-memory-bytes": ["1G"], "--kv-offloading-size": ["1"],
    "--num-gpu-blocks-override": ["64"], "--prefix-caching-hash-algo": ["xxhash"], "--log-level": ["DEBUG"],
    "--kv-cache-metrics": [], "--enable-mfu-metrics": [], "--max-num-batched-tokens": ["4k"], "--max-num-seqs": ["8"],
    "--scheduler-reserve-full-isl": "--no-scheduler-reserve-full-isl",
    "--kv-events-config": ['{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:5557"}'],
    "--disable-sliding-window": [],
    "--kv-transfer-config": ['{"kv_connector": "NixlConnector", "kv_role": "kv_both"}'],
    "--speculative-config": ['{"method": "ngram", "num_speculative_tokens": 3}'],
    # --speculative-config's shortcuts, valid only together: tests/frontend/serve/test_cli_speculative.py
    "--spec-method": None, "--spec-model": None, "--spec-tokens": None,
    # accepted, with nothing to pass on: read by the cli itself, or only kvpool's own behaviour accepted
    "--config": None, "--model": None, "--tokenizer": None, "--kv-cache-dtype": ["auto"], "--kv-offloading-backend": ["native"],
}
PASSED_SAMPLES = {ONE: ["7"], MANY: ["a", "b"], SWITCH: [], BOOL: []}
# Flags vLLM accepts only with another (given to both runs, so the flag alone is compared).
NEEDS = {"--enable-log-outputs": ["--enable-log-requests"], "--enable-auto-tool-choice": ["--tool-call-parser", "hermes"]}
# Passed flags whose value kvpool checks (vLLM's other values refused).
PASSED_VALUES = {"--tool-call-parser": ["hermes"]}


@pytest.fixture
def fixed_ports(monkeypatch):
    monkeypatch.setattr(launcher, "free_ports", lambda n: list(range(20001, 20001 + n)))


def argvs(argv: list[str]) -> dict[str, list[str]]:
    la = launcher.Launcher(parse_serve(["serve", "m", *argv]), log=lambda *a, **k: None)
    la.build()
    return {name: c.argv for name, c in la.children.items()}


def test_the_table_has_every_flag_with_vllms_group_arity_and_spellings():
    ours = {(g.title, r.arity, r.option_strings) for g in GROUPS for r in g.rules}
    theirs = {(group, arity, tuple(strings.split())) for group, arity, _default, strings in VLLM}
    assert len(VLLM) == 316 and len(all_rules()) == 316
    assert theirs - ours == set() and ours - theirs == set()


def test_help_groups_the_flags_as_vllm_does_then_kvpools_own():
    out = subprocess.run([sys.executable, "-m", "frontend.serve.cli", "serve", "--help"], capture_output=True, text=True, timeout=60,
                         cwd=REPO).stdout
    headings = [m for m in re.findall(r"^(\S[^:\n]*):$", out, re.MULTILINE) if m != "positional arguments"]
    vllm_order = list(dict.fromkeys(group for group, *_ in VLLM))
    assert headings == [*vllm_order, "kvpool's own"]
    assert out.startswith("usage: kvpool serve [MODEL] [options]")


def _refused_value(rule: Rule):
    """A value of ``rule`` outside its accepted ones, and its argv."""
    if rule.arity in (SWITCH, BOOL):
        on = True not in (rule.accepts or ())
        return on, [rule.name] if on else [f"--no-{rule.name[2:]}"]
    if rule.arity == MANY:
        return ["a", "b"], [rule.name, "a", "b"]
    return "7", [rule.name, "7"]


@pytest.mark.parametrize("rule", [r for r in all_rules() if r.verdict == REFUSED], ids=lambda r: r.name)
def test_a_refused_flag_is_named_with_its_reason_and_its_accepted_values_pass(rule):
    _, argv = _refused_value(rule)
    with pytest.raises(Refused) as e:
        parse_serve(["serve", "m", *argv])
    line = str(e.value)
    assert line.startswith(f"kvpool serve: {' '.join(argv)}: ") and line.endswith(rule.note) and "\n" not in line
    for accepted in rule.accepts:
        given = [rule.name] if accepted is True else [f"--no-{rule.name[2:]}"] if accepted is False else [rule.name, accepted]
        parse_serve(["serve", "m", *given])


@pytest.mark.parametrize("rule", [r for r in all_rules() if r.verdict in (SAME, PASSED, HANDLED)], ids=lambda r: r.name)
def test_an_accepted_flag_does_what_the_table_says(rule, fixed_ports):
    needs = NEEDS.get(rule.name, [])
    baseline = argvs(needs)
    if rule.verdict == HANDLED:
        sample = HANDLED_SAMPLES[rule.name]
        if sample is None:
            return  # --config, --model, --tokenizer: tests of their own
        given = [sample] if isinstance(sample, str) else [rule.name, *sample]
    elif rule.verdict == PASSED:
        given = [rule.name, *PASSED_VALUES.get(rule.name, PASSED_SAMPLES[rule.arity])]
    else:
        given = [rule.name] + {ONE: ["7"], MANY: ["a"], OPTIONAL: ["tok"]}.get(rule.arity, [])
    after = argvs(needs + given)
    if rule.verdict == SAME or HANDLED_SAMPLES.get(rule.name) in (["auto"], ["native"]):
        assert after == baseline
    elif rule.verdict == PASSED:
        for child in ("scheduler", "worker", "frontend"):
            argv = after[child]
            has = any(argv[i : i + len(given)] == given for i in range(len(argv)))
            assert has == (child in rule.to), child
    else:
        assert after != baseline


def test_every_handled_flag_has_a_sample():
    assert {r.name for r in all_rules() if r.verdict == HANDLED} == set(HANDLED_SAMPLES)


def test_the_doc_is_the_table():
    assert (REPO / "docs" / "vllm-serve-flags.md").read_text() == doc.render(), "run: python -m frontend.serve.flags.doc > docs/vllm-serve-flags.md"


def test_an_unknown_flag_is_still_argparses_error(capsys):
    with pytest.raises(SystemExit) as e:
        parse_serve(["serve", "m", "--swap-space", "4"])  # gone from vLLM 0.32, which refuses it the same way
    assert e.value.code == 2 and "unrecognized arguments: --swap-space 4" in capsys.readouterr().err


def test_show_hidden_metrics_for_version_takes_a_version_as_vllm_checks_it(fixed_ports, capsys):
    assert argvs(["--show-hidden-metrics-for-version", "0.31"]) == argvs([])  # vLLM 0.32 hides no metric behind it
    with pytest.raises(SystemExit) as e:
        parse_serve(["serve", "m", "--show-hidden-metrics-for-version", "not-a-version"])
    assert e.value.code == 2
    assert "--show-hidden-metrics-for-version: invalid version 'not-a-version'" in capsys.readouterr().err


def test_an_fp8_kv_cache_dtype_reaches_the_worker_and_the_scheduler(fixed_ports):
    for name in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        after = argvs(["--kv-cache-dtype", name])
        for child in ("worker", "scheduler"):
            i = after[child].index("--kv-cache-dtype")
            assert after[child][i + 1] == name, child
        assert "--kv-cache-dtype" not in after["frontend"]


def test_a_cache_dtype_vllm_does_not_know_is_argparses_error(capsys):
    with pytest.raises(SystemExit) as e:
        parse_serve(["serve", "m", "--kv-cache-dtype", "fp4"])
    assert e.value.code == 2 and "argument --kv-cache-dtype: invalid choice: 'fp4'" in capsys.readouterr().err


def test_calculate_kv_scales_is_unknown_as_in_vllm_0_32(capsys):
    # vLLM 0.32 dropped --calculate-kv-scales (its scales are 1.0 or the checkpoint's), so
    # its parser refuses the flag as unknown; kvpool's does the same.
    with pytest.raises(SystemExit) as e:
        parse_serve(["serve", "m", "--kv-cache-dtype", "fp8", "--calculate-kv-scales"])
    assert e.value.code == 2 and "unrecognized arguments: --calculate-kv-scales" in capsys.readouterr().err
