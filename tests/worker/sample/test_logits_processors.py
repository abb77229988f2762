"""allowed_token_ids, bad_words and logit_bias in the batched sampler, against hand-worked
logits and vLLM's rules (``vllm/v1/sample/ops/bad_words.py``, ``builtin.py``, the order of
``Sampler.apply_logits_processors``)."""

from __future__ import annotations

import math

import pytest
import torch

from protocol.sampling_params import SamplingParams
from worker.sample.logits_processors import banned_by_bad_words
from worker.sample.sampling_state import SamplingState

V = 16
CPU = torch.device("cpu")


def ramp() -> torch.Tensor:
    """Logits 0.0, 0.1, ..., 1.5: greedy picks the last token, V - 1."""
    return torch.arange(V, dtype=torch.float32) / 10


def one_step(params: SamplingParams | None, logits: torch.Tensor, tokens: list[int] | None = None, num_prompt: int = 1):
    tokens = tokens or [0]
    state = SamplingState(2, V, CPU)
    state.add(0, params, tokens, num_prompt)
    sampled, logprobs = state.sample(logits[None, :], [0], [len(tokens) - num_prompt], lambda i: tokens)
    return sampled[0], logprobs[0]


@pytest.mark.parametrize(("words", "output", "banned"), [
    ([[5]], [], [5]),  # one token: always
    ([[3, 5]], [], []),  # longer than the output + 1: never
    ([[3, 5]], [7, 3], [5]),  # the rest of the word is the latest output
    ([[3, 5]], [3, 7], []),
    ([[1, 2, 5], [9]], [4, 1, 2], [5, 9]),
    ([[1, 2, 5]], [2], []),  # only one output token: a three-token word cannot end here
])
def test_bad_words_ban_a_last_token_only_after_the_rest(words, output, banned):
    assert banned_by_bad_words(words, output) == banned


def test_greedy_rows_honour_logit_bias():
    # token 2 at 0.2 + 100 beats token 15 at 1.5
    assert one_step(SamplingParams(logit_bias={2: 100.0}), ramp())[0] == 2
    # a negative bias pushes the greedy choice to the next best
    assert one_step(SamplingParams(logit_bias={V - 1: -1.0}), ramp())[0] == V - 2


def test_allowed_token_ids_limit_greedy_and_random_rows():
    assert one_step(SamplingParams(allowed_token_ids=[3, 7, 4]), ramp())[0] == 7
    state = SamplingState(2, V, CPU)
    state.add(0, SamplingParams(temperature=1.0, allowed_token_ids=[1, 9]), [0], 1)
    drawn = {state.sample(ramp()[None, :], [0], [i])[0][0] for i in range(200)}
    assert drawn == {1, 9}


def test_bad_words_read_output_tokens_not_the_prompt():
    word = SamplingParams(bad_words_token_ids=[[3, V - 1]])
    # the prompt ends in 3: no output yet, so the two-token word cannot end here
    assert one_step(word, ramp(), [0, 3], num_prompt=2)[0] == V - 1
    # the output ends in 3: V - 1 would complete the word
    assert one_step(word, ramp(), [0, 3], num_prompt=1)[0] == V - 2
    assert one_step(SamplingParams(bad_words_token_ids=[[V - 1], [V - 2]]), ramp())[0] == V - 3


def test_logit_bias_comes_before_the_repetition_penalty():
    # vLLM: bias, then penalties. Token 5 is in the prompt: (1.0 + 1.0) / 2 = 1.0 < 1.2
    # (token 6); the other order would give 1.0 / 2 + 1.0 = 1.5 and pick token 5.
    logits = torch.zeros(V)
    logits[5], logits[6] = 1.0, 1.2
    p = SamplingParams(logit_bias={5: 1.0}, repetition_penalty=2.0)
    assert one_step(p, logits, [5], num_prompt=1)[0] == 6


def test_logprobs_stay_the_models_raw_ones():
    token, lp = one_step(SamplingParams(logit_bias={2: 100.0}, logprobs=1), ramp())
    raw = ramp().log_softmax(-1)
    assert token == 2
    assert math.isclose(lp.logprob, raw[2].item(), rel_tol=1e-6)
    assert lp.top_token_ids == [V - 1]  # the raw top token, not the biased one


def test_rows_without_processors_are_untouched_in_a_mixed_batch():
    state = SamplingState(4, V, CPU)
    state.add(0, SamplingParams(logit_bias={2: 100.0}), [0], 1)
    state.add(1, None, [0], 1)
    state.add(2, SamplingParams(allowed_token_ids=[4]), [0], 1)
    state.add(3, SamplingParams(temperature=0.0, top_k=3), [0], 1)
    logits = ramp().repeat(4, 1)
    tokens, _ = state.sample(logits, [0, 1, 2, 3], [0, 0, 0, 0], lambda i: [0])
    assert tokens == [2, V - 1, 4, V - 1]
    assert torch.equal(logits, ramp().repeat(4, 1))  # the caller's logits are not written
    state.remove(0)
    state.add(0, None, [0], 1)  # a reused table row forgets the old processors
    assert state.sample(ramp()[None, :], [0], [0])[0] == [V - 1]
