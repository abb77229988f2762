"""Value types and choices of the settings table's flags, parsed as ``vllm serve``
parses them."""

from __future__ import annotations

import argparse

from protocol.human_readable import human_readable_int

__all__ = ["DTYPES", "LOG_LEVELS", "VLLM_CACHE_DTYPES", "dtype", "fraction", "gib", "human_readable_int",
           "human_readable_int_or_auto", "seed"]

# vLLM's --dtype: the model's weights' and (with --kv-cache-dtype auto) its KV cache's;
# and float64, kvpool's own, in which the reference tests' greedy tokens have no near-ties.
DTYPES = ("auto", "bfloat16", "float16", "float32", "float64")
# vLLM's aliases of two of them.
DTYPE_ALIASES = {"half": "float16", "float": "float32"}

# vLLM 0.32's --log-level choices; kvpool's processes log at four of them.
LOG_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG", "NOTSET")

# vLLM 0.32's CacheDType: argparse's choices, as vLLM's; kvpool serves KV_CACHE_DTYPES of them.
VLLM_CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla", "nvfp4_ds_mla",
                     "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc", "ultraquant_4bit",
                     "int4_per_token_head", "int8_per_token_head", "fp8_per_token_head", "nvfp4", "nvfp4_4over6")


def dtype(text: str) -> str:
    """A --dtype name, vLLM's aliases (half, float) as the names they stand for."""
    return DTYPE_ALIASES.get(text, text)


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


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid fraction {text!r}: expected a number in (0, 1]") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"invalid fraction {text!r}: expected a number in (0, 1]")
    return value


def gib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: expected a number of GiB, e.g. 4 or 0.5") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: expected a number of GiB >= 0")
    return value
