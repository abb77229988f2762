"""Value types of ``kvpool serve``'s flags that parse as ``vllm serve``'s do (those of
the flags that reach a child: protocol/serve_flags/values.py)."""

from __future__ import annotations

import argparse

from packaging.version import InvalidVersion, Version

from protocol.human_readable import human_readable_int

__all__ = ["human_readable_int", "version"]


def version(text: str) -> str:
    """As vLLM's ObservabilityConfig checks --show-hidden-metrics-for-version: a PEP 440
    version (``packaging.version.parse``), kept as given."""
    try:
        Version(text)
    except InvalidVersion:
        raise argparse.ArgumentTypeError(f"invalid version {text!r}: expected a version such as 0.31") from None
    return text
