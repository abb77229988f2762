"""A step's tokens to the clients: one `EngineCoreOutputs` frame per client per step.

`outputs_by_client` builds each client's batch straight from the scheduler's
`StepTokens` columns (no per-request object on the way), in batch order,
as vLLM's `Scheduler.update_from_output` groups its EngineCoreOutputs by client.
`send_outputs` encodes each batch once and sends them all without waiting
(`RouterPort.send_batch`); it returns the clients that could not be sent to (gone,
or not reading), for the caller to drop.
"""

from __future__ import annotations

from collections.abc import Iterable

from protocol.client_messages import EngineCoreOutputs, TokenLogprobs, TokenOutput
from protocol.codec import Codec
from protocol.prompt_logprobs import PromptLogprobs
from protocol.worker_messages import SampledLogprobs
from scheduler.engine.sockets import RouterPort
from scheduler.sched.outputs import StepTokens
from scheduler.sched.request import Request


def outputs_by_client(step: StepTokens, logprobs: Iterable[SampledLogprobs] = (),
                      prompt_logprobs: dict[int, PromptLogprobs] | None = None) -> dict[bytes, EngineCoreOutputs]:
    """client id -> that client's TokenOutputs of this step, in batch order.
    ``prompt_logprobs`` (seq_id -> them): with the first token of the rows that asked."""
    batches: dict[bytes, list[TokenOutput]] = {}
    outputs: list[TokenOutput] = []
    more = step.more_token_ids
    for i, (r, token_id) in enumerate(zip(step.requests, step.token_ids, strict=True)):
        # NOTE: a request that sampled was admitted, so its num_cached_tokens is set (>= 0).
        new = [token_id] if not more or i not in more else [token_id, *more[i]]
        out = TokenOutput(r.request_id, new, num_cached_tokens=r.num_cached_tokens)
        outputs.append(out)
        batch = batches.get(r.client_id)
        if batch is None:
            batches[r.client_id] = [out]
        else:
            batch.append(out)
    for i, reason in step.finish_reasons.items():
        outputs[i].finished = True
        outputs[i].finish_reason = reason
        # A prefill engine's request: where a decode engine reads its blocks (scheduler/sched/pd_connector.py).
        outputs[i].kv_transfer_params = step.requests[i].kv_transfer_answer
    # NOTE: only rows whose SamplingParams asked for logprobs have them (rarely any).
    if logprobs:
        index = {r.seq_id: i for i, r in enumerate(step.requests)}
        for lp in logprobs:
            i = index.get(lp.seq_id)
            if i is None:
                continue
            out = outputs[i]
            if out.logprobs is None:
                out.logprobs = []
            # A row of several tokens (verified drafts) has one entry per token, in order; those
            # past a stop that ended it are dropped with their tokens.
            if len(out.logprobs) < len(out.new_token_ids):
                out.logprobs.append(TokenLogprobs(lp.logprob, lp.top_token_ids, lp.top_logprobs))
    if prompt_logprobs:
        for i, r in enumerate(step.requests):
            plp = prompt_logprobs.get(r.seq_id)
            if plp is not None:
                outputs[i].prompt_logprobs = plp
    return {client: EngineCoreOutputs(batch) for client, batch in batches.items()}


def final_outputs_by_client(requests: Iterable[Request], finish_reason: str) -> dict[bytes, EngineCoreOutputs]:
    """The last (token-less) TokenOutput of each request ended outside a step
    (abort, shutdown), grouped by client."""
    batches: dict[bytes, list[TokenOutput]] = {}
    for r in requests:
        out = TokenOutput(r.request_id, [], True, finish_reason, max(r.num_cached_tokens, 0))
        batches.setdefault(r.client_id, []).append(out)
    return {client: EngineCoreOutputs(batch) for client, batch in batches.items()}


def send_outputs(port: RouterPort, codec: Codec, batches: dict[bytes, EngineCoreOutputs]) -> list[bytes]:
    """One encode and one send per client, none waiting; the clients whose send failed."""
    encode = codec.encode
    return port.send_batch([(client, encode(batch)) for client, batch in batches.items()])
