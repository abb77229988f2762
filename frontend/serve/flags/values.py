"""Value types of ``kvpool serve``'s flags that parse as ``vllm serve``'s do."""

from __future__ import annotations

import argparse

from packaging.version import InvalidVersion, Version

from protocol.human_readable import human_readable_int

__all__ = ["DTYPES", "human_readable_int", "human_readable_int_or_auto", "seed", "version"]


def human_readable_int_or_auto(text: str) -> int | None:
    """As vLLM's --max-model-len: ``-1`` or ``auto`` (None here) is the model's own length."""
    if text.strip() == "-1" or text.strip().lower() == "auto":
        return None
    return human_readable_int(text)


def seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < 2**64:
        raise argparse.ArgumentTypeError(f"invalid seed {text!r}: expected an integer in 0..2**64-1")
    return value


def version(text: str) -> str:
    """As vLLM's ObservabilityConfig checks --show-hidden-metrics-for-version: a PEP 440
    version (``packaging.version.parse``), kept as given."""
    try:
        Version(text)
    except InvalidVersion:
        raise argparse.ArgumentTypeError(f"invalid version {text!r}: expected a version such as 0.31") from None
    return text


# vLLM's --dtype choices; "half" and "float" are its aliases of float16 and float32.
DTYPES = {"auto": "auto", "bfloat16": "bfloat16", "float": "float32", "float16": "float16", "float32": "float32", "half": "float16"}
