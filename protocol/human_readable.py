"""vLLM's human-readable integers (``1k``, ``2K``, ``25.6k``), as every process's
command line reads them: ``kvpool serve`` passes such values on verbatim."""

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
