"""A request's prompt logprobs, joined from the worker's parts.

The worker sends what each step's chunks scored of a prompt (``StepResult.
prompt_logprobs``: a frame bounded by the step's token budget), and an entry for a
row in the step that samples its first token. The scheduler joins the parts on the
request and, with that first token, hands the whole prompt's to the client, as vLLM
returns them all at once at the end of prefill. A request sent back to the waiting
queue before its first token (preemption, a lost worker) is scored afresh from
position 0: ``Scheduler._requeue`` drops its parts.
"""

from __future__ import annotations

from protocol.prompt_logprobs import PromptLogprobs
from protocol.worker_messages import StepResult
from scheduler.sched.request import Request


def join(head: PromptLogprobs | None, tail: PromptLogprobs) -> PromptLogprobs:
    if head is None:
        return tail
    return PromptLogprobs(head.token_logprobs + tail.token_logprobs, head.ranks + tail.ranks,
                          head.top_token_ids + tail.top_token_ids, head.top_logprobs + tail.top_logprobs)


def gather_prompt_logprobs(seq_id_to_request: dict[int, Request], result: StepResult) -> dict[int, PromptLogprobs]:
    """Join the result's parts onto their requests (before the result is applied: a
    request it finishes is still known); the whole prompts of the rows that sample
    their first token in it, by seq_id. A part for a request gone meanwhile (aborted
    with the step in flight) is dropped."""
    if not result.prompt_logprobs:
        return {}
    sampled = set(result.seq_ids)
    whole = {}
    for seq_id, part in result.prompt_logprobs.items():
        request = seq_id_to_request.get(seq_id)
        if request is None:
            continue
        joined = join(request.prompt_logprobs, part)
        if seq_id in sampled:
            whole[seq_id], request.prompt_logprobs = joined, None
        else:
            request.prompt_logprobs = joined
    return whole
