"""Value types of ``kvpool serve``'s flags that parse as ``vllm serve``'s do."""

from __future__ import annotations

import argparse
import re

_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_readable_int(text: str) -> int:
    """vLLM's: ``1k`` is 1,000, ``1K`` 1,024, ``25.6k`` 25,600; decimals only with k/m/g/t."""
    value = text.strip()
    if m := re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", value):
        number, suffix = m.groups()
        if suffix in _DECIMAL:
            return int(float(number) * _DECIMAL[suffix])
        if "." in number:
            raise argparse.ArgumentTypeError(f"invalid value {text!r}: no decimals with {suffix}; did you mean {number}{suffix.lower()}?")
        return int(number) * _BINARY[suffix]
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: expected an integer such as 2048, 2k or 2K") from None


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


# vLLM's --dtype choices; "half" and "float" are its aliases of float16 and float32.
DTYPES = {"auto": "auto", "bfloat16": "bfloat16", "float": "float32", "float16": "float16", "float32": "float32", "half": "float16"}
