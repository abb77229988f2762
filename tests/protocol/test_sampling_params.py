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
)  # fmt: skip
def test_non_finite_values_are_refused_as_vllm_does(field, value):
    e = error_of(**{field: value})
    assert e.param == field and str(e) == f"{field} must be a finite number, got {value}."


def test_the_message_is_vllms_and_the_field_is_named():
    e = error_of(temperature=-0.5)
    assert (e.param, str(e)) == ("temperature", "temperature must be non-negative, got -0.5.")
    assert isinstance(e, ValueError)  # what scheduler/sched/validation.py catches


def test_stop_ids_are_bounded_by_the_vocabulary_only_when_it_is_given():
    e = error_of(stop_token_ids=[3, 512])
    assert e.param == "stop_token_ids" and "512 is outside the vocabulary (0..511)" in str(e)
    check_sampling(Generate("r", [1], max_tokens=10, stop_token_ids=[3, 512]), None)


def test_values_at_their_limits_pass():
    check_sampling(Generate("ok", [1], max_tokens=10, temperature=0.0, top_p=1.0, top_k=-1, min_p=1.0,
                            presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=1e-3, min_tokens=10,
                            logprobs=20, stop_token_ids=[0, 511], seed=-5), 512)  # fmt: skip
