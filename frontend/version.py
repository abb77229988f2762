"""Which versions this server reports: the vLLM release whose HTTP API it implements
(``/version``'s ``version``, what vLLM clients parse) and kvpool's own."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

# NOTE: the vLLM release every behaviour is checked against (the one in .venv-vllm).
VLLM_API_VERSION = "0.32.0"


def kvpool_version() -> str:
    try:
        return version("kvpool")
    except PackageNotFoundError:  # pragma: no cover - run from a source tree
        return "0.0.0"
