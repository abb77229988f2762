"""Prompt logprobs at the HTTP edge, as vLLM 0.32 shows them: the request checks
(``CompletionRequest``/``ChatCompletionRequest.check_logprobs``), a choice's
``prompt_logprobs`` field (a list with None for the first prompt token, then one
``{token_id: {logprob, rank, decoded_token}}`` per position, the prompt token first),
and the prompt's part of a completion's ``logprobs`` under ``echo``.
"""

from __future__ import annotations

from frontend.openai.logprobs import completion_logprobs
from frontend.schema.errors import bad_request
from frontend.text.logprob_tokens import decoded_tokens
from frontend.text.tokenizer import Tokenizer
from protocol.prompt_logprobs import PromptLogprobs


def _clamp(lp: float) -> float:
    return max(lp, -9999.0)  # NOTE: JSON has no -inf; vLLM sends -9999.0 (clamp_prompt_logprobs)


def whole_vocabulary(ctx) -> int:
    """What vLLM's -1 asks for (logprobs, prompt_logprobs): the model's whole vocabulary
    (config.json's, read once at start), else the tokenizer's."""
    return ctx.vocab_size or ctx.tokenizer.vocab_size


def check_logprob_fields(req, top_field: str) -> None:
    """vLLM's ``check_logprobs`` validator, before anything else of the request:
    ``top_field`` is "logprobs" (completions) or "top_logprobs" (chat)."""
    plp = req.prompt_logprobs
    if plp is not None:
        if req.stream and (plp > 0 or plp == -1):
            raise bad_request("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
        if plp < 0 and plp != -1:
            raise bad_request("`prompt_logprobs` must be a positive value or -1.", "prompt_logprobs")
    top = getattr(req, top_field)
    if top is not None and top < 0 and top != -1:
        raise bad_request(f"`{top_field}` must be a positive value or -1.", top_field)


def num_prompt_logprobs(req, ctx, asked: int | None) -> int | None:
    """The prompt logprobs the engine computes (``asked``: the request's, else what echo
    implies), checked against --max-logprobs as vLLM's ``_validate_logprobs`` (-1: the
    whole vocabulary, so over any bound this server allows)."""
    if not asked:
        return asked
    n = asked if asked != -1 else whole_vocabulary(ctx)
    if n > ctx.config.max_logprobs:
        raise bad_request(f"Requested prompt logprobs of {n}, which is greater than max allowed: {ctx.config.max_logprobs}", "prompt_logprobs")
    return n


def position_tokens(tokenizer: Tokenizer, prompt_ids: list[int], i: int, ids: list[int]) -> list[str]:
    """The decoded_token of each of ``ids`` at scored position ``i`` (prompt token i+1):
    the context is the prompt tokens scored before it (vLLM's, which skips the first)."""
    return decoded_tokens(tokenizer, ids, prompt_ids[max(1, i - 3) : i + 1])


def prompt_logprobs_json(tokenizer: Tokenizer, prompt_ids: list[int], plp: PromptLogprobs | None) -> list | None:
    """A choice's ``prompt_logprobs``: None for the first token, then per position the
    prompt token's {logprob, rank, decoded_token} and the top-k's (ranks 1..k)."""
    if plp is None:
        return None
    out: list[dict | None] = [None]
    for i, (lp, rank) in enumerate(zip(plp.token_logprobs, plp.ranks, strict=True)):
        tid = prompt_ids[i + 1]
        top_ids = plp.top_token_ids[i] if plp.top_token_ids else []
        texts = position_tokens(tokenizer, prompt_ids, i, [tid, *top_ids])
        entry = {str(tid): {"logprob": _clamp(lp), "rank": rank, "decoded_token": texts[0]}}
        if top_ids:
            for r, (t, v, text) in enumerate(zip(top_ids, plp.top_logprobs[i], texts[1:], strict=True), start=1):
                # NOTE: a dict, as vLLM's: the prompt token keeps its place, a top-k entry its values.
                entry[str(t)] = {"logprob": _clamp(v), "rank": r, "decoded_token": text}
        out.append(entry)
    return out


def echo_logprobs(tokenizer: Tokenizer, prompt_ids: list[int], plp: PromptLogprobs, num: int, as_ids: bool,
                  text_offset: int = 0) -> dict:
    """The prompt tokens' part of a completion's ``logprobs`` under echo (vLLM's
    ``_create_completion_logprobs`` over prompt_logprobs): the first token has None
    for its logprob and top_logprobs; each other shows the prompt token, then the
    top-k, as many as ``num`` + 1 of them."""
    first = f"token_id:{prompt_ids[0]}" if as_ids else tokenizer.decode([prompt_ids[0]], skip_special_tokens=False)
    tokens, token_logprobs, top, offsets = [first], [None], [None], [text_offset]
    text_offset += len(first)
    for i, lp in enumerate(plp.token_logprobs):
        tid = prompt_ids[i + 1]
        entries = {tid: lp}
        if plp.top_token_ids:
            entries.update(zip(plp.top_token_ids[i], plp.top_logprobs[i], strict=True))
        ids = list(entries)
        texts = [f"token_id:{t}" for t in ids] if as_ids else position_tokens(tokenizer, prompt_ids, i, ids)
        s = texts[0]
        tokens.append(s)
        token_logprobs.append(_clamp(lp))
        top.append({text: _clamp(entries[t]) for j, (t, text) in enumerate(zip(ids, texts, strict=True)) if num == -1 or j <= num})
        offsets.append(text_offset)
        text_offset += len(s)
    return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens, "top_logprobs": top}


def join_logprobs(head: dict, tail: dict | None) -> dict:
    """Two runs of completion logprobs, one after the other."""
    if tail is None:
        return head
    return {k: head[k] + tail[k] for k in ("text_offset", "token_logprobs", "tokens", "top_logprobs")}


def echoed_completion_logprobs(tokenizer: Tokenizer, req, prompt: list[int], plp: PromptLogprobs | None, token_ids: list[int],
                               logprobs, as_ids: bool, echo_only: bool, text_offset: int = 0) -> dict:
    """A completion choice's (or its stream's first chunk's) logprobs: with echo the prompt's
    tokens first (vLLM's prompt logprobs), then the generated ones (none when echo_only)."""
    if not req.echo or plp is None:
        return completion_logprobs(tokenizer, token_ids, logprobs, req.logprobs, as_ids, text_offset)
    head = echo_logprobs(tokenizer, prompt, plp, req.logprobs, as_ids, text_offset)
    if echo_only:
        return head
    end = head["text_offset"][-1] + len(head["tokens"][-1])
    return join_logprobs(head, completion_logprobs(tokenizer, token_ids, logprobs, req.logprobs, as_ids, end))
