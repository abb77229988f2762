"""validate_generate: each bad request is refused with a message naming the problem;
a valid one passes and nothing is changed either way."""

from __future__ import annotations

import pytest

from protocol.client_messages import Generate
from scheduler.sched.validation import RequestLimits, RequestRejected, validate_generate

# 512-token vocabulary, 256-token context, 16-token blocks, 8 usable blocks (128 slots).
LIMITS = RequestLimits(vocab_size=512, max_model_len=256, block_size=16, num_usable_blocks=8)


def rejected(msg: Generate, live=()) -> str:
    live = set(live)
    before = set(live)
    with pytest.raises(RequestRejected) as info:
        validate_generate(msg, LIMITS, live)
    assert live == before
    return str(info.value).lower()


def test_a_valid_request_passes():
    validate_generate(Generate("ok", [0, 1, 511], max_tokens=10), LIMITS, {"other"})
    # Exactly at the limits: 129 tokens written = 128 slots (the last sampled token is never written).
    validate_generate(Generate("edge", [5] * 100, max_tokens=29), LIMITS, set())


def test_duplicate_request_id():
    m = rejected(Generate("r1", [1, 2]), live={"r1"})
    assert "duplicate" in m and "r1" in m


def test_empty_prompt():
    m = rejected(Generate("r", []))
    assert "prompt cannot be empty" in m


@pytest.mark.parametrize("bad", [512, 513, 2**31 - 1])
def test_token_id_outside_the_vocabulary(bad):
    m = rejected(Generate("r", [1, bad, 2]))
    assert "vocabulary" in m and str(bad) in m and "511" in m


@pytest.mark.parametrize("max_tokens", [0, -1, -(2**40)])
def test_max_tokens_below_one(max_tokens):
    m = rejected(Generate("r", [1], max_tokens=max_tokens))
    assert "max_tokens" in m and "at least 1" in m


def test_prompt_plus_max_tokens_over_max_model_len():
    m = rejected(Generate("r", [1] * 200, max_tokens=57))
    assert "max_model_len" in m and "257" in m and "256" in m
    # 2**62 tokens must not overflow into acceptance.
    assert "max_model_len" in rejected(Generate("r", [1], max_tokens=2**62))


def test_more_blocks_than_the_pool_holds():
    # 131 tokens, 130 written: 9 blocks > 8 usable.
    m = rejected(Generate("r", [1] * 100, max_tokens=31))
    assert "blocks" in m and "9" in m and "8" in m and "pool" in m


def test_first_problem_is_named():
    # Duplicate id and empty prompt: the id comes first.
    assert "duplicate" in rejected(Generate("r", []), live={"r"})


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", -0.5), ("temperature", float("inf")), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2),
    ("min_p", -0.1), ("min_p", 1.01), ("presence_penalty", 2.5), ("frequency_penalty", -3.0),
    ("repetition_penalty", 0.0), ("min_tokens", -1), ("min_tokens", 11), ("logprobs", 21), ("logprobs", -1),
    ("stop_token_ids", [3, 512]),
])
def test_out_of_range_sampling_parameters_name_the_field(field, value):
    m = rejected(Generate("r", [1, 2], max_tokens=10, **{field: value}))
    assert field in m


def test_sampling_parameters_at_their_limits_pass():
    validate_generate(Generate("ok", [1], max_tokens=10, temperature=0.0, top_p=1.0, top_k=-1, min_p=1.0,
                               presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=1e-3,
                               min_tokens=10, logprobs=20, stop_token_ids=[0, 511], seed=-5), LIMITS, set())
