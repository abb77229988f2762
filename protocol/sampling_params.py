"""vLLM's SamplingParams subset, as the worker receives it with a request's row.

The client's ``Generate`` carries the same fields flat (``protocol.client_messages``);
the scheduler checks them (``check_sampling``) and hands the worker this struct, or
None for plain greedy decoding with no logprobs (most benchmark traffic), so such a
row costs no bytes on the worker wire.
"""

from __future__ import annotations

import msgspec

MAX_LOGPROBS = 20
# NOTE: vLLM's _SAMPLING_EPS: a temperature below it is greedy.
GREEDY_TEMPERATURE = 1e-5


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True):
    temperature: float = 0.0  # below GREEDY_TEMPERATURE: greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0 or -1: every token
    min_p: float = 0.0  # [0, 1]
    seed: int | None = None  # a generator of its own: the same tokens whatever the batch
    presence_penalty: float = 0.0  # [-2, 2], over output tokens
    frequency_penalty: float = 0.0  # [-2, 2], over output tokens
    repetition_penalty: float = 1.0  # > 0, over prompt and output tokens
    # While fewer than min_tokens are sampled, these cannot be (EOS included unless
    # ignore_eos: the scheduler folds it in).
    min_tokens: int = 0
    stop_token_ids: list[int] = []
    logprobs: int | None = None  # the sampled token's logprob and the top-k, k <= MAX_LOGPROBS

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


GREEDY = SamplingParams()


def check_sampling(msg, vocab_size: int) -> None:
    """Raise ValueError naming the first out-of-range sampling field of ``msg`` (any
    object with SamplingParams' attribute names, plus max_tokens)."""

    def bad(field: str, rule: str) -> ValueError:
        return ValueError(f"{field} {getattr(msg, field)!r} is out of range: {rule}")

    if not msg.temperature >= 0 or msg.temperature == float("inf"):
        raise bad("temperature", "must be >= 0 (0 is greedy)")
    if not 0 < msg.top_p <= 1:
        raise bad("top_p", "must be in (0, 1]")
    if msg.top_k < -1:
        raise bad("top_k", "must be -1 or 0 (every token), or at least 1")
    if not 0 <= msg.min_p <= 1:
        raise bad("min_p", "must be in [0, 1]")
    for field in ("presence_penalty", "frequency_penalty"):
        if not -2 <= getattr(msg, field) <= 2:
            raise bad(field, "must be in [-2, 2]")
    if not 0 < msg.repetition_penalty < float("inf"):
        raise bad("repetition_penalty", "must be > 0 (1 is none)")
    if msg.min_tokens < 0 or msg.min_tokens > msg.max_tokens:
        raise bad("min_tokens", f"must be in [0, max_tokens] (max_tokens is {msg.max_tokens})")
    if msg.logprobs is not None and not 0 <= msg.logprobs <= MAX_LOGPROBS:
        raise bad("logprobs", f"must be in [0, {MAX_LOGPROBS}]")
    if msg.seed is not None and not -(2**63) <= msg.seed < 2**63:
        raise bad("seed", "must fit in 64 bits")
    wrong = next((t for t in msg.stop_token_ids if not 0 <= t < vocab_size), None)
    if wrong is not None:
        raise ValueError(f"stop_token_ids: token id {wrong} is outside the vocabulary (0..{vocab_size - 1})")


def sampling_params_of(msg, eos_token_ids: tuple[int, ...] = ()) -> SamplingParams | None:
    """The worker's SamplingParams for a checked request, None when it is plain greedy.
    ``eos_token_ids`` join the stop ids that min_tokens masks (unless ignore_eos)."""
    stop = list(msg.stop_token_ids)
    if msg.min_tokens and not getattr(msg, "ignore_eos", False):
        stop += [t for t in eos_token_ids if t not in stop]
    p = SamplingParams(
        temperature=msg.temperature, top_p=msg.top_p, top_k=msg.top_k, min_p=msg.min_p, seed=msg.seed,
        presence_penalty=msg.presence_penalty, frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty, min_tokens=msg.min_tokens,
        stop_token_ids=stop if msg.min_tokens else [], logprobs=msg.logprobs,
    )
    return None if p == GREEDY else p
