"""The pytest plugin of the run of vLLM's core tests through the shim.

Installs the stub finder (so a test file's imports of vLLM names kvpool lacks still
load) and sorts every test into passed, failed or not runnable, with a reason:

* not runnable: it used a name the shim leaves unmapped (NotMapped), or a call shape
  kvpool does not take (a TypeError or AttributeError: an argument or a method that
  is not there), or its file could not be collected, or it was skipped;
* failed: anything else raised (an assertion: kvpool answered differently).

The results go, as JSON {test id: [outcome, reason]}, to $VLLM_CORE_REPORT.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
from vllm.unmapped import NotMapped, StubFinder

sys.meta_path.append(StubFinder())
RESULTS: dict[str, list[str]] = {}


@pytest.fixture
def caplog_vllm(caplog):
    """vLLM's conftest fixture: pytest's caplog (the shim's loggers propagate)."""
    return caplog


def first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= 120 else line[:117] + "..."


def classify(excinfo) -> list[str]:
    if excinfo.errisinstance(NotMapped):
        return ["not runnable", f"not mapped: {excinfo.value}"]
    if excinfo.errisinstance((TypeError, AttributeError)):
        return ["not runnable", f"shape: {excinfo.typename}: {first_line(str(excinfo.value))}"]
    return ["failed", f"{excinfo.typename}: {first_line(str(excinfo.value))}"]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if item.nodeid in RESULTS and RESULTS[item.nodeid][0] != "passed":
        return
    if report.skipped:
        RESULTS[item.nodeid] = ["not runnable", f"skipped: {first_line(str(report.longrepr[-1]))}"]
    elif report.failed and call.excinfo is not None:
        RESULTS[item.nodeid] = classify(call.excinfo)
    elif report.when == "call":
        RESULTS[item.nodeid] = ["passed", ""]


def pytest_collectreport(report):
    if report.failed:
        RESULTS[report.nodeid] = ["not runnable", f"collection: {first_line(str(report.longrepr).splitlines()[-1])}"]


def pytest_sessionfinish(session):
    path = os.environ.get("VLLM_CORE_REPORT")
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(RESULTS, f, indent=0, sort_keys=True)
