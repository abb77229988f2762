"""vLLM's ``--speculative-config`` JSON: what kvpool drafts with, checked as vLLM checks it.

kvpool drafts without a draft model: ``"method": "ngram"`` (prompt lookup; vLLM's
NgramProposer; ``"[ngram]"`` is vLLM's alias) or ``"method": "suffix"`` (suffix decoding;
vLLM's SuffixDecodingProposer over Arctic Inference's suffix trees). The defaults and refusals
are vLLM 0.32's (``vllm/config/speculative.py``), in its words: for ngram, num_speculative_tokens
must be given and > 0, prompt_lookup_min and prompt_lookup_max default to each other, or to 5
when neither is given, and min <= max; for suffix, num_speculative_tokens (a cap: the drafts'
lengths vary) defaults to suffix_decoding_max_tree_depth (24), which must be >= 1,
suffix_decoding_max_cached_requests (10000) >= 0, suffix_decoding_max_spec_factor (1.0) >= 0
and suffix_decoding_min_token_prob (0.1) in [0, 1]. Every other method (EAGLE, Medusa, MTP, a
draft model, ...) is refused by name, as is any field its method does not read.

Both the API server (to refuse a bad flag before anything starts) and the scheduler (which
drafts) parse it with `parse_speculative_config`.
"""

from __future__ import annotations

import json

import msgspec

NGRAM = "ngram"
SUFFIX = "suffix"
# The fields of each method's own, and those every method reads (enforce_eager: no graphs here either way).
_OWN_FIELDS = {
    NGRAM: ("prompt_lookup_min", "prompt_lookup_max"),
    SUFFIX: ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests", "suffix_decoding_max_spec_factor",
             "suffix_decoding_min_token_prob"),
}
_FIELDS = {method: ("method", "num_speculative_tokens", *own, "enforce_eager") for method, own in _OWN_FIELDS.items()}
_METHOD_NAMES = {NGRAM: "n-gram drafting", SUFFIX: "suffix decoding"}
_DEFAULT_LOOKUP = 5  # vLLM: "arbitrarily chosen"
# vLLM's suffix decoding defaults.
_DEFAULT_TREE_DEPTH, _DEFAULT_CACHED_REQUESTS, _DEFAULT_SPEC_FACTOR, _DEFAULT_MIN_TOKEN_PROB = 24, 10000, 1.0, 0.1


class SpeculativeConfig(msgspec.Struct, frozen=True):
    """Up to ``num_speculative_tokens`` drafts a step for each decoding request. ngram: the
    tokens that followed the earliest earlier occurrence of its longest suffix of
    prompt_lookup_min..prompt_lookup_max tokens. suffix: the likeliest continuation of its
    last tokens in suffix trees of its prompt and of recent responses (scheduler/spec/suffix_proposer.py)."""

    num_speculative_tokens: int
    prompt_lookup_min: int = _DEFAULT_LOOKUP
    prompt_lookup_max: int = _DEFAULT_LOOKUP
    method: str = NGRAM
    suffix_decoding_max_tree_depth: int = _DEFAULT_TREE_DEPTH
    suffix_decoding_max_cached_requests: int = _DEFAULT_CACHED_REQUESTS
    suffix_decoding_max_spec_factor: float = _DEFAULT_SPEC_FACTOR
    suffix_decoding_min_token_prob: float = _DEFAULT_MIN_TOKEN_PROB

    def to_json(self) -> str:
        """The JSON ``parse_speculative_config`` reads back as this config (its method's fields only)."""
        fields = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}
        for name in _OWN_FIELDS[self.method]:
            fields[name] = getattr(self, name)
        return json.dumps(fields)


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
    if method not in _FIELDS:
        raise ValueError(f"method {method!r} is not supported: kvpool drafts by n-gram prompt lookup or suffix "
                         f"decoding, with no draft model (\"method\": \"ngram\" or \"suffix\")")
    other = sorted(k for k in fields if k not in _FIELDS[method])
    if other:
        raise ValueError(f"field {other[0]!r} is not supported with {_METHOD_NAMES[method]}")
    k = _positive_int(fields, "num_speculative_tokens")
    if method == SUFFIX:
        return _suffix_config(fields, k)
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


def _number(fields: dict, name: str, default: int | float, kind: type) -> int | float:
    """The field (``default`` when absent), an int, or for ``kind`` float an int or a float."""
    value = fields.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise ValueError(f"{name} must be {'a number' if kind is float else 'an integer'}, got {value!r}")
    return kind(value)


def _suffix_config(fields: dict, k: int | None) -> SpeculativeConfig:
    """Suffix decoding's fields, checked in vLLM's order and words (its ``_validate_suffix_decoding``)."""
    depth = _number(fields, "suffix_decoding_max_tree_depth", _DEFAULT_TREE_DEPTH, int)
    cached = _number(fields, "suffix_decoding_max_cached_requests", _DEFAULT_CACHED_REQUESTS, int)
    factor = _number(fields, "suffix_decoding_max_spec_factor", _DEFAULT_SPEC_FACTOR, float)
    prob = _number(fields, "suffix_decoding_min_token_prob", _DEFAULT_MIN_TOKEN_PROB, float)
    if depth < 1:
        raise ValueError(f"suffix_decoding_max_tree_depth={depth} must be >= 1")
    if cached < 0:
        raise ValueError(f"suffix_decoding_max_cached_requests={cached} must be >= 0")
    if factor < 0:
        raise ValueError(f"suffix_decoding_max_spec_factor={factor} must be >= 0")
    if not 0 <= prob <= 1:
        raise ValueError(f"suffix_decoding_min_token_prob={prob} must be in [0, 1]")
    # vLLM: the drafts' lengths vary; num_speculative_tokens only caps them, at the tree's depth unless given.
    return SpeculativeConfig(depth if k is None else k, method=SUFFIX, suffix_decoding_max_tree_depth=depth,
                             suffix_decoding_max_cached_requests=cached, suffix_decoding_max_spec_factor=factor,
                             suffix_decoding_min_token_prob=prob)
