"""A step's sampled tokens, appended to their requests: `Scheduler.update_from_output`'s loop.

Once the result is matched to the plan in flight, `append_sampled_tokens` appends
each request's token and says which requests are done (max_tokens, max_model_len, or
a stop token once min_tokens are out), in row order, with the step's `StepTokens`. It
touches the requests only: the scheduler ends the done ones itself, in that order (the
order their blocks are freed in); the prompts that got their first token are
counted in the scheduler's `PromptTokenStats`.
"""

from __future__ import annotations

import time

from scheduler.sched.outputs import StepTokens
from scheduler.sched.prompt_token_stats import PromptTokenStats
from scheduler.sched.request import Request, RequestStatus


def append_sampled_tokens(
    requests: list[Request], token_ids: list[int], block_size: int, prompt_stats: PromptTokenStats,
    extra_token_ids: dict[int, list[int]] | None = None,
) -> tuple[StepTokens, list[tuple[Request, RequestStatus]]]:
    """Append ``token_ids[i]`` to ``requests[i]`` (the result's rows, matched); a
    request whose first token this is goes into ``prompt_stats``. ``extra_token_ids``
    (seq_id -> them): a row's further tokens of the step (verified drafts), appended one
    by one after its first until one ends the request; the rest are dropped, as vLLM does.

    Returns the step's tokens (less those of requests ended, aborted, while the step
    ran), and the requests this step ended, in row order, with how.
    NOTE: a tuple, not an object: this runs once per step, and the decode step of one
    request costs a few microseconds in all."""
    # NOTE: once per sampled row per step: locals, no properties, and one test for
    # the common case, a token that fills no block, ends nothing and is not the
    # first (request.append_only_below, kept by _append_token).
    now = time.monotonic()
    prev_token_times: list[float | None] = []
    append_prev = prev_token_times.append
    outputs = StepTokens(now, requests, token_ids, prev_token_times)
    done: list[tuple[Request, RequestStatus]] = []
    skipped: list[int] = []
    for request, token_id in zip(requests, token_ids, strict=True):
        all_token_ids = request.all_token_ids
        if extra_token_ids and request.seq_id in extra_token_ids:
            pass  # several tokens: the general case
        elif len(all_token_ids) < request.append_only_below and token_id not in request.stop_token_ids:
            all_token_ids.append(token_id)
            append_prev(request.last_token_time)
            request.last_token_time = now
            continue
        # The general case; this request's index in the outputs is:
        i = len(prev_token_times)
        append_prev(request.last_token_time)
        if request.status is not RequestStatus.RUNNING:
            skipped.append(i)  # ended (aborted) while the step ran
            continue
        if request.last_token_time is None:
            # Its first token. As vLLM counts it: the whole prompt, cached tokens included, once.
            prompt_stats.record(request)
        status = _append_token(request, token_id, now, block_size)
        more = extra_token_ids.get(request.seq_id) if extra_token_ids else None
        if more is not None and status is None:
            kept = []
            for token in more:
                kept.append(token)
                status = _append_token(request, token, now, block_size)
                if status is not None:
                    break
            outputs.more_token_ids[i] = kept
        if status is not None:
            outputs.finish_reasons[i] = status.value
            done.append((request, status))
    if skipped:
        outputs = outputs.without(skipped)
    return outputs, done


def _append_token(request: Request, token_id: int, now: float, block_size: int) -> RequestStatus | None:
    """append_sampled_tokens' general case for one sampled token of a running
    request: its first token, a token that fills a block (hashed now, cached
    when next scheduled), or its last. Returns how it ends, if it does."""
    request.append_output_token_id(token_id)
    num_tokens = len(request.all_token_ids)
    if request.last_token_time is None:
        request.first_token_time = now
    request.last_token_time = now
    # NOTE: as vLLM, a stop token counts once min_tokens outputs came before it.
    stops = token_id in request.stop_token_ids and num_tokens - request.num_prompt_tokens > request.min_tokens
    if num_tokens < request.max_num_tokens and not stops:
        # The next token takes the fast path unless it fills a block or is the last.
        request.append_only_below = min(request.max_num_tokens - 1, (num_tokens // block_size + 1) * block_size - 1)
        return None
    return RequestStatus.FINISHED_STOPPED if num_tokens < request.max_num_tokens else RequestStatus.FINISHED_LENGTH
