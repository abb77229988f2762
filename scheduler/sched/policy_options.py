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
* ``--watermark F``: admitting a waiting (or preempted) request while others run
  must leave int(F * num_gpu_blocks) blocks free (vLLM's KVCacheManager
  watermark_blocks, its null block counted); F in [0, 1), 0: off.
* ``--max-num-scheduled-tokens N``: the tokens one step may schedule; the step's
  budget is the smaller of it and --max-num-batched-tokens (vLLM's token_budget and
  input_budget, without speculative decoding); default: --max-num-batched-tokens.
* ``--max-num-active-seqs N``: the most requests RUNNING at once: admission stops
  there (vLLM's max_num_active_reqs); --max-num-seqs still sizes the worker's rows.
  At most --max-num-seqs; default: --max-num-seqs.

The flags are the settings table's rows (protocol/serve_flags/scheduling.py POLICY_ROWS).
"""

from __future__ import annotations

SCHEDULING_POLICIES = ("fcfs", "priority")
# The Scheduler's keyword options these flags set, by their argparse dest.
POLICY_KWARGS = ("long_prefill_token_threshold", "long_prefill_token_threshold_adaptive", "enable_chunked_prefill",
                 "watermark", "max_num_scheduled_tokens", "max_num_active_seqs")


def policy_kwargs(config) -> dict:
    """The Scheduler's keyword options from a config with these flags' fields (the
    scheduler process's and the simulator's): one list, so neither misses a new one."""
    return {name: getattr(config, name) for name in POLICY_KWARGS}


def check_scheduler_options(
    max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, *, enable_chunked_prefill: bool = True,
    long_prefill_token_threshold: int = 0, watermark: float = 0.0, max_num_scheduled_tokens: int | None = None,
    max_num_active_seqs: int | None = None,
) -> None:
    """vLLM's ``SchedulerConfig`` checks, its wording with the flags' names: raise
    ValueError naming the first problem."""
    if max_num_seqs < 1 or max_num_batched_tokens < 1:
        raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
    if long_prefill_token_threshold < 0:
        raise ValueError(f"--long-prefill-token-threshold must be >= 0 (0: off), got {long_prefill_token_threshold}")
    if not 0.0 <= watermark < 1.0:  # NOTE: NaN fails too
        raise ValueError(f"--watermark must be in the range [0.0, 1.0) (0.0: off), got {watermark}")
    if max_num_scheduled_tokens is not None and max_num_scheduled_tokens < 1:
        raise ValueError(f"--max-num-scheduled-tokens must be >= 1, got {max_num_scheduled_tokens}")
    if max_num_active_seqs is not None and max_num_active_seqs < 1:
        raise ValueError(f"--max-num-active-seqs must be >= 1, got {max_num_active_seqs}")
    if max_num_active_seqs is not None and max_num_active_seqs > max_num_seqs:
        raise ValueError(f"max_num_active_seqs ({max_num_active_seqs}) cannot be greater than max_num_seqs ({max_num_seqs}).")
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


def step_budget(max_num_batched_tokens: int, max_num_scheduled_tokens: int | None) -> int:
    """The tokens one step may schedule: vLLM's token_budget (max_num_scheduled_tokens,
    default max_num_batched_tokens) and input_budget (max_num_batched_tokens) fall
    together without draft slots, so the smaller binds."""
    if max_num_scheduled_tokens is None:
        return max_num_batched_tokens
    return min(max_num_scheduled_tokens, max_num_batched_tokens)
