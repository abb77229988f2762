"""The ``compare``-marked tests run vLLM itself: they need ``.venv-vllm`` (``make
compare`` installs it) and must be selected with ``-m compare``, so never in CI."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def real_vllm(request) -> Path:
    """The repository root, once vLLM's venv is there and ``-m compare`` asked for it."""
    if not (ROOT / ".venv-vllm/bin/vllm").exists():
        pytest.skip("no .venv-vllm (make compare installs it)")
    if "compare" not in (request.config.getoption("-m") or ""):
        pytest.skip("runs vLLM for minutes: select it with -m compare")
    return ROOT
