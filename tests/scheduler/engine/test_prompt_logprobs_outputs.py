"""A step's prompt logprobs reach the client with the first token of the request whose
row computed them, over the client wire and back, and no other output carries any."""

from __future__ import annotations

from protocol.client_messages import ClientResponse, EngineCoreOutputs
from protocol.codec import Codec
from protocol.prompt_logprobs import PromptLogprobs
from protocol.worker_messages import StepResult, WorkerToScheduler
from scheduler.engine.client_outputs import outputs_by_client
from scheduler.sched.outputs import StepTokens
from scheduler.sched.request import Request

A, B = b"client-a", b"client-b"


def _request(rid: str, seq_id: int, client: bytes) -> Request:
    r = Request(rid, [3, 4, 5], 4, seq_id=seq_id, client_id=client)
    r.num_cached_tokens = 0
    return r


def test_prompt_logprobs_travel_worker_to_client_with_their_request():
    plp = PromptLogprobs([-1.5, -0.25], [7, 1], [[9], [5]], [[-0.5], [-0.25]])
    # The worker's result, through its codec, as the scheduler receives it.
    wire = Codec(WorkerToScheduler)
    result = wire.decode(wire.encode(StepResult(3, [11, 12], [8, 9], prompt_logprobs={12: plp})))
    assert result.prompt_logprobs == {12: plp}
    reqs = [_request("a0", 11, A), _request("b0", 12, B)]
    batches = outputs_by_client(StepTokens(1.0, reqs, [8, 9], [None, None]), [], result.prompt_logprobs)
    (a0,) = batches[A].outputs
    (b0,) = batches[B].outputs
    assert a0.prompt_logprobs is None and b0.prompt_logprobs == plp
    client = Codec(ClientResponse)
    assert client.decode(client.encode(batches[B])) == EngineCoreOutputs([b0])
