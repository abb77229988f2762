"""protocol/sampling_params.py's check_sampling: the one copy of the sampling ranges,
used by the scheduler (every client's Generate) and the frontend (before it sends)."""

from __future__ import annotations

import pytest

from protocol.client_messages import Generate
from protocol.sampling_params import SamplingError, check_sampling

INF, NAN = float("inf"), float("nan")


def error_of(vocab_size: int | None = 512, **fields) -> SamplingError:
    with pytest.raises(SamplingError) as info:
        check_sampling(Generate("r", [1], max_tokens=10, **fields), vocab_size)
    return info.value


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", INF), ("temperature", NAN), ("temperature", -INF), ("repetition_penalty", INF),
     ("repetition_penalty", NAN)],
)
def test_non_finite_values_are_refused_as_vllm_does(field, value):
    e = error_of(**{field: value})
    assert e.param == field and str(e) == f"{field} must be a finite number, got {value}."


def test_the_message_is_vllms_and_the_field_is_named():
    e = error_of(temperature=-0.5)
    assert (e.param, str(e)) == ("temperature", "temperature must be non-negative, got -0.5.")
    assert isinstance(e, ValueError)  # what scheduler/sched/validation.py catches


def test_stop_ids_are_bounded_by_the_vocabulary_only_when_it_is_given():
    e = error_of(stop_token_ids=[3, 512, 600])
    # vLLM's SamplingParams._validate_stop_token_ids, as a live vllm serve words it
    assert (e.param, str(e)) == ("stop_token_ids", "token_id(s) [512, 600] in stop_token_ids contain out-of-vocab token ids. "
                                                   "Vocabulary size: 512 (parameter=stop_token_ids, value=[512, 600])")
    check_sampling(Generate("r", [1], max_tokens=10, stop_token_ids=[3, 512]), None)


@pytest.mark.parametrize(("fields", "param", "message"), [
    # vLLM 0.32's SamplingParams.verify / update_from_tokenizer words, as a live vllm serve
    # answered them (the suffix is VLLMValidationError's)
    ({"logit_bias": {5: 1.0, 512: 2.0}}, "logit_bias",
     "token_id(s) [512] in logit_bias contain out-of-vocab token ids. Vocabulary size: 512 (parameter=logit_bias, value=[512])"),
    ({"allowed_token_ids": []}, "allowed_token_ids", "allowed_token_ids is not None and empty! (parameter=allowed_token_ids, value=[])"),
    ({"allowed_token_ids": [1, 512]}, "allowed_token_ids",
     "allowed_token_ids contains out-of-vocab token id! (parameter=allowed_token_ids, value=[512])"),
    ({"bad_words_token_ids": [[1, 600]]}, "bad_words",
     "The model vocabulary size is 512, but the following tokens were specified as bad: [600]. "
     "All token id values should be integers satisfying: 0 <= token_id <= 511. (parameter=bad_words, value=[600])"),
    ({"bad_words_token_ids": [[1], []]}, "bad_words", "bad_words entries must tokenize to at least one token."),
    ({"bad_words_token_ids": [[1]] * 129}, "bad_words", "Too many bad words after tokenization: 129. The max number is 128."),
])
def test_logits_processor_token_ids_are_checked_as_vllm_does(fields, param, message):
    e = error_of(**fields)
    assert (e.param, str(e)) == (param, message)


def test_values_at_their_limits_pass():
    check_sampling(Generate("ok", [1], max_tokens=10, temperature=0.0, top_p=1.0, top_k=-1, min_p=1.0,
                            presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=1e-3, min_tokens=10,
                            logprobs=20, stop_token_ids=[0, 511], seed=-5), 512)
