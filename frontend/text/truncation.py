"""``truncate_prompt_tokens`` and ``truncation_side``, as vLLM 0.32's renderer applies
them (``vllm/renderers/params.py``, ``TokenizeParams``).

k tokens of the prompt are kept: the last k (vLLM's generate tokenizers truncate on
the left), or the first k with ``truncation_side: "right"``; -1 is the context less
one token for output (the whole context when the request sets no output budget).
Without an explicit side, a text prompt is truncated by the tokenizer, which keeps the
special tokens it adds (a BOS stays first); with one, the encoded ids are sliced, and
a token-id prompt is always sliced.
"""

from __future__ import annotations

from frontend.schema.errors import bad_request


def check_truncation(truncate_prompt_tokens: int | None, max_model_len: int) -> None:
    """vLLM's ``TokenizeParams.__post_init__`` bound, its words."""
    t = truncate_prompt_tokens
    if t is not None and t > max_model_len:
        raise bad_request(f"truncate_prompt_tokens={t} cannot be greater than max_model_len = {max_model_len}. "
                          f"Please request a smaller truncation size. (parameter=truncate_prompt_tokens, value={t})",
                          "truncate_prompt_tokens")


def tokens_kept(truncate_prompt_tokens: int | None, max_model_len: int, max_output_tokens: int | None) -> int | None:
    """How many prompt tokens truncation keeps (None: no truncation); vLLM's
    ``max_truncation_tokens`` for -1."""
    t = truncate_prompt_tokens
    if t is None or t >= 0:
        return t
    return max_model_len if not max_output_tokens else max(0, max_model_len - 1)


def truncate_ids(token_ids: list[int], keep: int | None, side: str | None) -> list[int]:
    """The first or (by default) last ``keep`` ids."""
    if keep is None or keep >= len(token_ids):
        return token_ids
    if keep == 0:
        return []
    return token_ids[:keep] if side == "right" else token_ids[-keep:]


def encode_truncated(tokenizer, text: str, add_special_tokens: bool, keep: int | None, side: str | None) -> list[int]:
    """A text prompt's ids, truncated as vLLM's renderer truncates it."""
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    if keep is None or keep >= len(ids):
        return ids
    if side is not None or not add_special_tokens:
        return truncate_ids(ids, keep, side)
    # NOTE: the tokenizer's own (left) truncation, as transformers' encode(max_length=k):
    # the special tokens it adds stay, the text's tokens make room for them.
    plain = tokenizer.encode(text, add_special_tokens=False)
    start = next((i for i in range(len(ids) - len(plain) + 1) if ids[i:i + len(plain)] == plain), None)
    if start is None:  # the specials are not around the text: slice it all
        return truncate_ids(ids, keep, side)
    prefix, suffix = ids[:start], ids[start + len(plain):]
    room = max(0, keep - len(prefix) - len(suffix))
    return prefix + (plain[-room:] if room else []) + suffix
