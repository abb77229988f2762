"""Logprobs in the two shapes the OpenAI API has: the completions one (parallel lists)
and the chat one (a list of token objects), as vLLM fills them. A token is shown as
its own decoded text, or as ``token_id:N`` with ``return_tokens_as_token_ids``."""

from __future__ import annotations

from frontend.tokenizer import Tokenizer
from protocol.client_messages import TokenLogprobs


def _clamp(lp: float) -> float:
    # NOTE: JSON has no -inf; vLLM sends -9999.0 for it.
    return max(lp, -9999.0)


def token_str(tokenizer: Tokenizer, token_id: int, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids else tokenizer.token_text(token_id)


def completion_logprobs(tokenizer: Tokenizer, token_ids: list[int], logprobs: list[TokenLogprobs], num: int,
                        as_ids: bool, text_offset: int = 0) -> dict:  # fmt: skip
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token_id, lp in zip(token_ids, logprobs, strict=False):
        s = token_str(tokenizer, token_id, as_ids)
        tokens.append(s)
        token_logprobs.append(_clamp(lp.logprob))
        entry = {token_str(tokenizer, t, as_ids): _clamp(v) for t, v in zip(lp.top_token_ids[:num], lp.top_logprobs[:num], strict=False)}
        entry.setdefault(s, _clamp(lp.logprob))
        top.append(entry)
        offsets.append(text_offset)
        text_offset += len(s)
    return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens, "top_logprobs": top}


def chat_logprobs(tokenizer: Tokenizer, token_ids: list[int], logprobs: list[TokenLogprobs], num: int, as_ids: bool) -> dict:
    content = []
    for token_id, lp in zip(token_ids, logprobs, strict=False):
        s = token_str(tokenizer, token_id, as_ids)
        top = [
            {"token": (ts := token_str(tokenizer, t, as_ids)), "logprob": _clamp(v), "bytes": list(ts.encode("utf-8"))}
            for t, v in zip(lp.top_token_ids[:num], lp.top_logprobs[:num], strict=False)
        ]
        content.append({"token": s, "logprob": _clamp(lp.logprob), "bytes": list(s.encode("utf-8")), "top_logprobs": top})
    return {"content": content}
