"""What tests that run the real vllm-router share."""

from __future__ import annotations

import os

import pytest

from bench.replicas import router_binary


def require_router() -> None:
    """Skip naming the reason where vllm-router is missing; fail under CI, which
    installs the test extra that has it."""
    if router_binary() is None:
        msg = "vllm-router not found beside this interpreter or on PATH (pip install vllm-router; the test extra has it)"
        if os.environ.get("CI"):
            pytest.fail(msg + "; CI installs the test extra, so it must be there")
        pytest.skip(msg)
