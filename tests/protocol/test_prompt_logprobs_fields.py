"""prompt_logprobs on the wire: the native Generate's field, bounded as vLLM bounds it
(--max-logprobs' ceiling, 20) in vLLM's words, carried to the worker's SamplingParams,
and the PromptLogprobs columns round-tripping in a TokenOutput."""

from __future__ import annotations

import pytest

from protocol.client_messages import (
    ClientRequest,
    ClientResponse,
    EngineCoreOutputs,
    Generate,
    TokenOutput,
)
from protocol.codec import Codec
from protocol.prompt_logprobs import PromptLogprobs
from protocol.sampling_params import SamplingError, check_sampling, sampling_params_of


def test_generate_carries_prompt_logprobs_to_the_worker():
    g = Generate("r", [1, 2, 3], prompt_logprobs=0)
    codec = Codec(ClientRequest)
    assert codec.decode(codec.encode(g)).prompt_logprobs == 0
    check_sampling(g, 512)
    # 0 still asks (the prompt token's own logprob and rank): not plain greedy any more.
    assert sampling_params_of(g).prompt_logprobs == 0
    assert sampling_params_of(Generate("r", [1, 2, 3])) is None


@pytest.mark.parametrize(("value", "message"), [
    (21, "Requested prompt logprobs of 21, which is greater than max allowed: 20"),
    (-1, "prompt_logprobs must be non-negative, got -1."),
])
def test_out_of_range_prompt_logprobs_are_named(value, message):
    with pytest.raises(SamplingError) as e:
        check_sampling(Generate("r", [1], prompt_logprobs=value), 512)
    assert str(e.value) == message and e.value.param == "prompt_logprobs"


def test_token_output_round_trips_its_prompt_logprobs():
    plp = PromptLogprobs([-1.25, -0.5], [4, 1], [[7, 8], [9, 3]], [[-0.25, -2.0], [-0.5, -1.0]])
    out = EngineCoreOutputs([TokenOutput("r", [5], prompt_logprobs=plp), TokenOutput("s", [6])])
    codec = Codec(ClientResponse)
    back = codec.decode(codec.encode(out))
    assert back.outputs[0].prompt_logprobs == plp and back.outputs[1].prompt_logprobs is None
    assert len(plp) == 2
