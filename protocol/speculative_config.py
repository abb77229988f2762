"""vLLM's ``--speculative-config`` JSON: what kvpool drafts with, checked as vLLM checks it.

kvpool drafts without a draft model: ``"method": "ngram"`` (prompt lookup; vLLM's
NgramProposer). ``"[ngram]"`` is vLLM's alias. The defaults and refusals are vLLM 0.32's
(``vllm/config/speculative.py``): num_speculative_tokens must be given and > 0;
prompt_lookup_min and prompt_lookup_max default to each other, or to 5 when neither is
given, and min <= max. Every other method (EAGLE, Medusa, MTP, a draft model, suffix
decoding's Arctic Inference tree, ...) is refused by name, as is any field n-gram drafting
does not read.

Both the API server (to refuse a bad flag before anything starts) and the scheduler (which
drafts) parse it with `parse_speculative_config`.
"""

from __future__ import annotations

import json

import msgspec

NGRAM = "ngram"
# The fields n-gram drafting reads (enforce_eager: no graphs here either way).
_NGRAM_FIELDS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "enforce_eager")
_DEFAULT_LOOKUP = 5  # vLLM: "arbitrarily chosen"


class SpeculativeConfig(msgspec.Struct, frozen=True):
    """N-gram drafting: up to ``num_speculative_tokens`` drafts a step for each decoding
    request, the tokens that followed the earliest earlier occurrence of its longest
    suffix of prompt_lookup_min..prompt_lookup_max tokens."""

    num_speculative_tokens: int
    prompt_lookup_min: int = _DEFAULT_LOOKUP
    prompt_lookup_max: int = _DEFAULT_LOOKUP
    method: str = NGRAM

    def to_json(self) -> str:
        return json.dumps({"method": self.method, "num_speculative_tokens": self.num_speculative_tokens,
                           "prompt_lookup_min": self.prompt_lookup_min, "prompt_lookup_max": self.prompt_lookup_max})


def _positive_int(fields: dict, name: str) -> int | None:
    value = fields.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer greater than 0, got {value!r}")
    return value


def load_speculative_fields(text: str | None) -> dict | None:
    """The flag's JSON as a dict (None: no flag, or ``null``). Raises ValueError unless it is a JSON object."""
    if text is None:
        return None
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e})") from None
    if fields is not None and not isinstance(fields, dict):
        raise ValueError(f"expected a JSON object, got {type(fields).__name__}")
    return fields


def parse_speculative_config(text: str | dict | None) -> SpeculativeConfig | None:
    """The flag's JSON (or its dict) -> the config; None for no speculation (no flag,
    ``null`` or ``{}``, as vLLM). Raises ValueError naming what is wrong."""
    fields = load_speculative_fields(text) if isinstance(text, str) else text
    if fields is None:
        return None
    if not isinstance(fields, dict):
        raise ValueError(f"expected a JSON object, got {type(fields).__name__}")
    if not fields:
        return None
    method = fields.get("method")
    if method == "[ngram]":
        method = NGRAM
    if method is None:
        raise ValueError("num_speculative_tokens was provided but without speculative model"
                         if "num_speculative_tokens" in fields else "no method given")
    if method != NGRAM:
        raise ValueError(f"method {method!r} is not supported: kvpool drafts by n-gram prompt lookup, "
                         f"with no draft model (\"method\": \"ngram\")")
    other = sorted(k for k in fields if k not in _NGRAM_FIELDS)
    if other:
        raise ValueError(f"field {other[0]!r} is not supported with n-gram drafting")
    k = _positive_int(fields, "num_speculative_tokens")
    if k is None:
        raise ValueError("num_speculative_tokens must be provided with speculative model unless the "
                         "draft model config contains an n_predict parameter")
    lo, hi = _positive_int(fields, "prompt_lookup_min"), _positive_int(fields, "prompt_lookup_max")
    if lo is None and hi is None:
        lo = hi = _DEFAULT_LOOKUP
    elif lo is None:
        lo = hi
    elif hi is None:
        hi = lo
    if lo > hi:
        raise ValueError(f"prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
    return SpeculativeConfig(k, lo, hi)
