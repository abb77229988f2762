"""vLLM's SamplingParams subset, as the worker receives it with a request's row.

The client's ``Generate`` carries the same fields flat (``protocol.client_messages``);
the scheduler checks them (``check_sampling``, which the frontend uses too) and hands
the worker this struct, or None for plain greedy decoding with no logprobs (most
benchmark traffic), so such a row costs no bytes on the worker wire.
"""

from __future__ import annotations

import math

import msgspec

MAX_LOGPROBS = 20
# vLLM's VLLM_MAX_NUM_BAD_WORDS default: token sequences after tokenization.
MAX_NUM_BAD_WORDS = 128
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
    # vLLM's logits processors (worker.sample.logits_processors), greedy rows included: only
    # these tokens may be sampled; token id -> bias added to its logit, in [-100, 100];
    # never the last token of one of these sequences after the rest of it.
    allowed_token_ids: list[int] | None = None
    logit_bias: dict[int, float] | None = None
    bad_words_token_ids: list[list[int]] = []
    # Each prompt token's logprob and the top-k (k <= MAX_LOGPROBS) at every prompt
    # position, returned once with the first sampled token (protocol.prompt_logprobs).
    prompt_logprobs: int | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


GREEDY = SamplingParams()


class SamplingError(ValueError):
    """A sampling field out of range: vLLM's message, and the field it names (the
    OpenAI error's ``param``)."""

    def __init__(self, message: str, param: str, value=None):
        # NOTE: given the value, vLLM's VLLMValidationError words: "... (parameter=p, value=v)".
        super().__init__(message if value is None else f"{message} (parameter={param}, value={value})")
        self.param = param


def check_sampling(msg, vocab_size: int | None = None) -> None:
    """Raise SamplingError naming the first out-of-range sampling field of ``msg`` (any
    object with SamplingParams' attribute names, plus max_tokens), in the words of
    vLLM's ``SamplingParams._verify_args``.

    The one copy of these ranges: the scheduler checks what every client sends, the
    frontend what it is about to send (so that a bad field is a 400 naming it). Given
    ``vocab_size`` (the model's, not the tokenizer's, which can be smaller), the token
    ids are checked against it too (`check_token_ids_in_vocab`)."""

    def out_of_range(field: str, message: str) -> SamplingError:
        return SamplingError(f"{field} {message}, got {getattr(msg, field)}.", field)

    if not math.isfinite(msg.temperature):
        raise out_of_range("temperature", "must be a finite number")
    if msg.temperature < 0.0:
        raise out_of_range("temperature", "must be non-negative")
    if not 0.0 < msg.top_p <= 1.0:
        raise out_of_range("top_p", "must be in (0, 1]")
    if msg.top_k < -1:
        raise out_of_range("top_k", "must be 0 (disable), or at least 1")
    if not 0.0 <= msg.min_p <= 1.0:
        raise out_of_range("min_p", "must be in [0, 1]")
    for field in ("presence_penalty", "frequency_penalty"):
        if not -2.0 <= getattr(msg, field) <= 2.0:
            raise out_of_range(field, "must be in [-2, 2]")
    if not math.isfinite(msg.repetition_penalty):
        raise out_of_range("repetition_penalty", "must be a finite number")
    if msg.repetition_penalty <= 0.0:
        raise out_of_range("repetition_penalty", "must be greater than zero")
    if msg.min_tokens < 0:
        raise out_of_range("min_tokens", "must be greater than or equal to 0")
    if msg.min_tokens > msg.max_tokens:
        raise out_of_range("min_tokens", f"must be less than or equal to max_tokens={msg.max_tokens}")
    if msg.logprobs is not None and msg.logprobs < 0:
        raise out_of_range("logprobs", "must be non-negative")
    if msg.logprobs is not None and msg.logprobs > MAX_LOGPROBS:
        raise SamplingError(
            f"Requested sample logprobs of {msg.logprobs}, which is greater than max allowed: {MAX_LOGPROBS}", "logprobs"
        )
    prompt_logprobs = getattr(msg, "prompt_logprobs", None)
    if prompt_logprobs is not None and prompt_logprobs < 0:
        raise out_of_range("prompt_logprobs", "must be non-negative")
    if prompt_logprobs is not None and prompt_logprobs > MAX_LOGPROBS:
        raise SamplingError(f"Requested prompt logprobs of {prompt_logprobs}, which is greater than max allowed: {MAX_LOGPROBS}",
                            "prompt_logprobs")
    if msg.seed is not None and not -(2**63) <= msg.seed < 2**63:
        raise out_of_range("seed", "must fit in 64 bits")
    if vocab_size is not None:
        check_token_ids_in_vocab(msg, vocab_size)


def check_token_ids_in_vocab(msg, vocab_size: int) -> None:
    """vLLM's ``SamplingParams.verify`` vocabulary checks (``_validate_logit_bias``,
    ``_validate_stop_token_ids``, ``_validate_allowed_token_ids``), its order and words,
    against the model's vocabulary size; then the bad words' ids (which vLLM checks
    against the tokenizer, where they come from)."""

    def invalid(ids) -> list[int]:
        return [t for t in ids if t < 0 or t >= vocab_size]

    for field in ("logit_bias", "stop_token_ids"):
        if bad := invalid(getattr(msg, field, None) or ()):
            raise SamplingError(f"token_id(s) {bad} in {field} contain out-of-vocab token ids. Vocabulary size: {vocab_size}",
                                field, bad)
    allowed = getattr(msg, "allowed_token_ids", None)
    if allowed is not None and len(allowed) == 0:
        raise SamplingError("allowed_token_ids is not None and empty!", "allowed_token_ids", [])
    if bad := invalid(allowed or ()):
        raise SamplingError("allowed_token_ids contains out-of-vocab token id!", "allowed_token_ids", bad)
    if bad := [t for word in getattr(msg, "bad_words_token_ids", ()) for t in invalid(word)]:
        raise SamplingError(f"The model vocabulary size is {vocab_size}, but the following tokens were specified as bad: {bad}. "
                            f"All token id values should be integers satisfying: 0 <= token_id <= {vocab_size - 1}.",
                            "bad_words", bad)
    bad_words = getattr(msg, "bad_words_token_ids", ())
    if any(not word for word in bad_words):
        raise SamplingError("bad_words entries must tokenize to at least one token.", "bad_words")
    if len(bad_words) > MAX_NUM_BAD_WORDS:
        raise SamplingError(f"Too many bad words after tokenization: {len(bad_words)}. The max number is {MAX_NUM_BAD_WORDS}.",
                            "bad_words")


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
        allowed_token_ids=msg.allowed_token_ids or None, logit_bias=msg.logit_bias or None,
        bad_words_token_ids=msg.bad_words_token_ids,
        prompt_logprobs=getattr(msg, "prompt_logprobs", None),
    )
    return None if p == GREEDY else p
