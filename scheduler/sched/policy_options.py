"""vLLM 0.32's scheduling-policy options (``vllm/config/scheduler.py``): their names,
their checks, and the long-prefill cap they make of a step.

* ``--scheduling-policy``: "fcfs" (arrival order) or "priority" (a request's
  ``priority``, lower first, then arrival; scheduler/sched/priority_scheduler.py).
* ``--long-prefill-token-threshold N``: no request is scheduled more than N tokens
  in a step, running or waiting, unless it is the only request (nobody to starve);
  0: off. ``--long-prefill-token-threshold-adaptive`` floors N at an equal share
  of the step's budget.
* ``--no-enable-chunked-prefill``: a waiting request whose (capped) tokens do not
  fit what is left of the step's budget is not split; admission stops there.
"""

from __future__ import annotations

SCHEDULING_POLICIES = ("fcfs", "priority")


def check_scheduler_options(
    max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, *, enable_chunked_prefill: bool = True,
    long_prefill_token_threshold: int = 0,
) -> None:  # fmt: skip
    """vLLM's ``SchedulerConfig`` checks, its wording with the flags' names: raise
    ValueError naming the first problem."""
    if max_num_seqs < 1 or max_num_batched_tokens < 1:
        raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
    if long_prefill_token_threshold < 0:
        raise ValueError(f"--long-prefill-token-threshold must be >= 0 (0: off), got {long_prefill_token_threshold}")
    if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
        raise ValueError(
            f"--max-num-batched-tokens ({max_num_batched_tokens}) is smaller than --max-model-len ({max_model_len}) "
            "with --no-enable-chunked-prefill. This effectively limits the maximum sequence length to "
            "max_num_batched_tokens (a prompt is never split across steps). Please increase --max-num-batched-tokens "
            "or decrease --max-model-len."
        )
    if long_prefill_token_threshold > max_model_len:
        raise ValueError(
            f"--long-prefill-token-threshold ({long_prefill_token_threshold}) cannot be greater than "
            f"the --max-model-len ({max_model_len})."
        )


def long_prefill_cap(threshold: int, adaptive: bool, max_num_batched_tokens: int, num_requests: int) -> int:
    """The most tokens one request may be scheduled this step (0: no cap), with
    ``num_requests`` running and waiting as the step starts (vLLM's ``schedule``)."""
    if threshold == 0 or num_requests <= 1:
        return 0  # NOTE: alone, a long prefill starves nobody: it may take the whole budget
    if adaptive:
        return max(threshold, max_num_batched_tokens // num_requests)
    return threshold
