"""Which versions this server reports: the vLLM release whose HTTP API it implements
(``/version``'s ``version``, what vLLM clients parse) and kvpool's own."""

from __future__ import annotations

import hashlib
from importlib.metadata import PackageNotFoundError, version

# NOTE: the vLLM release every behaviour is checked against (the one in .venv-vllm).
VLLM_API_VERSION = "0.32.0"


def kvpool_version() -> str:
    try:
        return version("kvpool")
    except PackageNotFoundError:  # pragma: no cover - run from a source tree
        return "0.0.0"


def system_fingerprint(config_json: bytes, served_model_name: str, max_model_len: int) -> str:
    """The answers' ``system_fingerprint``, in the shape of vLLM 0.32's default
    (``--fingerprint-mode full``: ``vllm-<version>-<hash8>``): kvpool's version and 8
    hex digits of a hash of what decides the answers here -- the checkpoint's
    config.json (its bytes, b"" for none), the served name and the context length. Two
    servers with one fingerprint answer alike; a changed model or context changes it."""
    h = hashlib.sha256(config_json)
    h.update(f"\0{served_model_name}\0{max_model_len}".encode())
    return f"kvpool-{kvpool_version()}-{h.hexdigest()[:8]}"
