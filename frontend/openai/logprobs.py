"""Logprobs in the two shapes the OpenAI API has: the completions one (parallel lists)
and the chat one (a list of token objects), as vLLM fills them. A token is shown as
its own decoded text, or as ``token_id:N`` with ``return_tokens_as_token_ids``."""

from __future__ import annotations

from frontend.text.logprob_tokens import decoded_tokens
from frontend.text.tokenizer import Tokenizer
from protocol.client_messages import TokenLogprobs


def _clamp(lp: float) -> float:
    # NOTE: JSON has no -inf; vLLM sends -9999.0 for it.
    return max(lp, -9999.0)


def _texts(tokenizer: Tokenizer, ids: list[int], as_ids: bool, context: list[int]) -> list[str]:
    return [f"token_id:{t}" for t in ids] if as_ids else decoded_tokens(tokenizer, ids, context)


def completion_logprobs(tokenizer: Tokenizer, token_ids: list[int], logprobs: list[TokenLogprobs], num: int,
                        as_ids: bool, text_offset: int = 0, context: list[int] = ()) -> dict:
    """``context``: the choice's output tokens before ``token_ids`` (a stream's earlier chunks)."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    seen = list(context)
    for token_id, lp in zip(token_ids, logprobs, strict=False):
        top_ids = lp.top_token_ids[:num]
        texts = _texts(tokenizer, [token_id, *top_ids], as_ids, seen)
        s = texts[0]
        tokens.append(s)
        token_logprobs.append(_clamp(lp.logprob))
        entry = {t: _clamp(v) for t, v in zip(texts[1:], lp.top_logprobs[:num], strict=False)}
        entry.setdefault(s, _clamp(lp.logprob))
        top.append(entry)
        offsets.append(text_offset)
        text_offset += len(s)
        seen.append(token_id)
    return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens, "top_logprobs": top}


def chat_logprobs(tokenizer: Tokenizer, token_ids: list[int], logprobs: list[TokenLogprobs], num: int, as_ids: bool,
                  context: list[int] = ()) -> dict:
    """``context``: the choice's output tokens before ``token_ids`` (a stream's earlier chunks)."""
    content = []
    seen = list(context)
    for token_id, lp in zip(token_ids, logprobs, strict=False):
        top_ids = lp.top_token_ids[:num]
        texts = _texts(tokenizer, [token_id, *top_ids], as_ids, seen)
        s = texts[0]
        top = [
            {"token": ts, "logprob": _clamp(v), "bytes": list(ts.encode("utf-8"))}
            for ts, v in zip(texts[1:], lp.top_logprobs[:num], strict=False)
        ]
        content.append({"token": s, "logprob": _clamp(lp.logprob), "bytes": list(s.encode("utf-8")), "top_logprobs": top})
        seen.append(token_id)
    return {"content": content}
