"""A request given again with the outputs it already streamed (``resumed_token_ids``, what
the frontend sends a restarted scheduler) goes on where it stopped: greedy, the tokens
after the resume are the reference's own continuation, max_tokens and min_tokens count
the resumed tokens, a penalty sees them as outputs; a resume that leaves nothing to
sample, leaves the vocabulary or asks for prompt logprobs again is refused by name."""

from __future__ import annotations

import random

import pytest
from kvtest.cluster import Cluster
from kvtest.hf_models import reference_generate

from protocol.client_messages import Generate

pytestmark = pytest.mark.e2e

PROMPT = [random.Random(3).randrange(5, 512) for _ in range(40)]


def test_a_resumed_request_continues_where_it_stopped(tmp_path, tiny_reference):
    greedy = reference_generate(tiny_reference, PROMPT, 24)
    stop = greedy[15]
    k = greedy.index(stop)
    with Cluster([], log_dir=tmp_path) as c:
        whole = c.generate([Generate("whole", PROMPT, 24, ignore_eos=True, frequency_penalty=1.5)])["whole"]
        out = c.generate([
            Generate("r", PROMPT, 24, ignore_eos=True, resumed_token_ids=greedy[:10]),
            # A penalty counts the resumed tokens as outputs, as a preempted request's.
            Generate("pen", PROMPT, 24, ignore_eos=True, frequency_penalty=1.5, resumed_token_ids=whole.token_ids[:10]),
            # min_tokens counts them: the stop token is held back only until then.
            Generate("mt", PROMPT, 24, ignore_eos=True, stop_token_ids=[stop], min_tokens=k, resumed_token_ids=greedy[:k]),
            Generate("too-many", PROMPT, 8, resumed_token_ids=greedy[:8]),
            Generate("vocab", PROMPT, 8, resumed_token_ids=[1, 10**6]),
            Generate("plp", PROMPT, 8, prompt_logprobs=2, resumed_token_ids=greedy[:2]),
        ])
    assert out["r"].error is None and out["r"].token_ids == greedy[10:] and out["r"].finish_reason == "length"
    assert whole.token_ids != greedy  # the penalty changed the text
    assert out["pen"].token_ids == whole.token_ids[10:]
    assert out["mt"].token_ids == [stop] and out["mt"].finish_reason == "stop"
    assert "resumed_token_ids" in out["too-many"].error and "max_tokens" in out["too-many"].error
    assert "1000000" in out["vocab"].error and "vocabulary" in out["vocab"].error
    assert "prompt_logprobs" in out["plp"].error
