"""A request's ``logit_bias``, ``allowed_token_ids`` and ``bad_words`` as the engine
takes them: token-level, checked with vLLM 0.32's words (``SamplingParams.from_optional``,
``_verify_args``, ``update_from_tokenizer`` and ``verify``'s vocabulary checks).

The worker applies them (``worker.sample.logits_processors``); the scheduler checks them again
for every client (``protocol.sampling_params.check_token_ids_in_vocab``).
"""

from __future__ import annotations

from dataclasses import replace

from frontend.sampling.params import EngineParams
from frontend.schema.errors import APIError, bad_request
from protocol.sampling_params import MAX_NUM_BAD_WORDS, SamplingError, check_token_ids_in_vocab

# vLLM clamps every bias into this range.
MAX_LOGIT_BIAS = 100.0


def logit_bias_of(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """vLLM's ``from_optional``: keys as int token ids (a key that is not one is a 400
    naming every such key), values clamped to [-100, 100]."""
    if not logit_bias:
        return None
    out, invalid = {}, []
    for key, bias in logit_bias.items():
        try:
            token_id = int(key)
        except (ValueError, TypeError):
            invalid.append(key)
            continue
        out[token_id] = min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, float(bias)))
    if invalid:
        raise bad_request(f"logit_bias contains key(s) that cannot be converted to integer token IDs: {invalid!r} "
                          f"(parameter=logit_bias, value={invalid!r})", "logit_bias")
    return out


def bad_words_token_ids(tokenizer, bad_words: list[str]) -> list[list[int]]:
    """vLLM's ``update_from_tokenizer``: each word (duplicates once) tokenized without
    special tokens as it is (left-stripped), and again after a space when that gives a
    new first token and as many tokens (the word in mid-text)."""
    out: list[list[int]] = []
    words = list(dict.fromkeys(bad_words))  # vLLM's SamplingParams keeps each once
    for word in words:
        for prefix in ("", " "):
            ids = tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False)
            if not ids:
                if not prefix:
                    raise bad_request(f"bad_words entries must tokenize to at least one token. (parameter=bad_words, value={words})",
                                      "bad_words")
                continue
            if not prefix or (ids[0] != out[-1][0] and len(ids) == len(out[-1])):
                out.append(ids)
                if len(out) > MAX_NUM_BAD_WORDS:
                    raise bad_request(f"Too many bad words after tokenization: {len(out)}. The max number is {MAX_NUM_BAD_WORDS}. "
                                      f"(parameter=bad_words, value={words})", "bad_words")
    return out


def with_logits_fields(params: EngineParams, req, tokenizer, vocab_size: int | None) -> EngineParams:
    """``params`` with the request's logits processors and its stop ids, checked.

    The token ids' range is the scheduler's check (vLLM's words, against the model's
    vocabulary): it answers as vLLM's engine does, a 400, or an error event in a stream.
    Only an id the engine message cannot carry (outside int64, where JSON's are not) is
    refused here, in the same words given ``vocab_size`` (the model's, from config.json);
    that and the bad words' own refusals are vLLM's engine's, so they are the returned
    params' ``refusal``, raised as the engine requests would start (in the stream)."""
    generate = dict(params.generate)
    bias = logit_bias_of(req.logit_bias)
    if req.bad_words and any(not w for w in req.bad_words):
        raise bad_request(f"bad_words cannot contain an empty string. Got bad_words={req.bad_words}")
    # NOTE: vLLM keeps each stop id once; repeats would only cost wire bytes.
    generate["stop_token_ids"] = list(dict.fromkeys(generate["stop_token_ids"]))
    allowed = req.allowed_token_ids
    fields = _Fields(bias, generate["stop_token_ids"], allowed)
    unfit = next((name for name in _FIELDS if not _fits_the_wire(getattr(fields, name))), None)
    if unfit is not None:
        refusal = bad_request(f"token_id(s) in {unfit} must be 64-bit integers", unfit)
        if vocab_size is not None:
            try:
                check_token_ids_in_vocab(fields, vocab_size)
            except SamplingError as e:
                refusal = bad_request(str(e), e.param)
        return replace(params, refusal=refusal)
    if bias:
        generate["logit_bias"] = bias
    if allowed is not None:
        # NOTE: a set to the sampler (vLLM's mask): repeats would only cost wire bytes.
        generate["allowed_token_ids"] = list(dict.fromkeys(allowed))
    if req.bad_words:
        try:
            generate["bad_words_token_ids"] = bad_words_token_ids(tokenizer, req.bad_words)
        except APIError as e:
            return replace(params, refusal=e)
    return replace(params, generate=generate)


_FIELDS = ("logit_bias", "stop_token_ids", "allowed_token_ids")  # vLLM's order of checks


def _fits_the_wire(token_ids) -> bool:
    return all(-(2**63) <= t < 2**63 for t in token_ids or ())


class _Fields:
    __slots__ = ("logit_bias", "stop_token_ids", "allowed_token_ids", "bad_words_token_ids")

    def __init__(self, logit_bias, stop_token_ids, allowed_token_ids):
        self.logit_bias, self.stop_token_ids, self.allowed_token_ids = logit_bias, stop_token_ids, allowed_token_ids
        self.bad_words_token_ids = []
