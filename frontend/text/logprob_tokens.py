"""The text a logprob shows for a token, as vLLM's ``LogprobsProcessor`` decodes it:
each token alone; one whose text ends in U+FFFD (a piece of an unfinished UTF-8
sequence, from byte fallback) decoded again after up to 4 preceding tokens of the
sequence -- the prompt's for prompt logprobs, the output's for sampled ones -- and ""
while the sequence is still unfinished there (``_verify_tokens``,
``_correct_decoded_token``)."""

from __future__ import annotations

from frontend.text.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


def _decode(tokenizer: Tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False)


def _corrected(tokenizer: Tokenizer, token_id: int, context: list[int]) -> str:
    for num_ctx in range(1, min(len(context), 4) + 1):
        ctx = context[-num_ctx:]
        full = _decode(tokenizer, ctx + [token_id])
        if full.endswith(_REPLACEMENT):
            continue
        # The context tokens that were themselves unfinished pieces showed "": their text is this token's.
        clean_end = len(ctx)
        for j in range(len(ctx) - 1, -1, -1):
            if not _decode(tokenizer, [ctx[j]]).endswith(_REPLACEMENT):
                break
            clean_end = j
        prefix = _decode(tokenizer, ctx[:clean_end]) if clean_end > 0 else ""
        if full.startswith(prefix):
            return full[len(prefix) :]
        common = 0
        for a, b in zip(prefix, full, strict=False):
            if a != b:
                break
            common += 1
        return full[common:]
    return ""


def decoded_tokens(tokenizer: Tokenizer, ids: list[int], context: list[int]) -> list[str]:
    """The texts of ``ids``, the alternatives at one position (the sequence's token and
    the top-k); ``context``: the sequence's tokens before that position."""
    out = []
    for t in ids:
        text = tokenizer.token_text(t)
        out.append(_corrected(tokenizer, t, context[-4:]) if text.endswith(_REPLACEMENT) else text)
    return out
