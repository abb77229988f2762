"""The per-request and per-step histograms of vLLM's PrometheusStatLogger, filled from
each executed step's `StepTokens`, as vLLM's IterationStats fills them.

A request's times are the scheduler's (time.monotonic()): it arrives (vLLM's
arrival and QUEUED), is first admitted (SCHEDULED, `Request.scheduled_time`; a
later admission after a preemption leaves it), gets its first token and its last.
At its end, as vLLM's ``update_from_finished_request``:

    queue = scheduled - arrival        prefill = first token - scheduled
    decode = last token - first token  inference = last token - scheduled
    time per output token = decode / (output tokens - 1), 0 with one token

Preemptions and lost workers inside those spans are in them, as in vLLM. Observed:
requests that end in a step (stop or length), and those their client ended on a stop
string (``Abort(stopped=True)``, at its arrival: tokens sampled after the stop string,
before the abort arrived, are in their decode time, where vLLM's output processor
stops the clock at the stop string's token). vLLM's output processor records no
finished-request stats for an aborted request, nor does this.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter as Tally
from collections.abc import Callable
from functools import partial

from prometheus_client import Histogram

from scheduler.engine.metric_buckets import histogram_buckets
from scheduler.sched.outputs import StepTokens
from scheduler.sched.request import Request

# (name, help text, buckets) -> the histogram's child for this engine's labels.
HistogramFactory = Callable[[str, str, tuple], Histogram]


class RequestMetrics:
    def __init__(self, histogram: HistogramFactory, max_model_len: int, custom_buckets: dict | None = None):
        """``custom_buckets``: --custom-histogram-buckets (family -> bounds; None: vLLM's)."""
        b = partial(histogram_buckets, overrides=custom_buckets)
        latency, itl, tokens = b("request_latency"), b("inter_token_latency"), b("request_tokens", max_model_len=max_model_len)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                          b("iteration_tokens"))
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              b("time_to_first_token"))
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             itl)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request.",
                              itl)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", latency)
        self.queue = histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
                               latency)
        self.inference = histogram("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.",
                                   latency)
        self.prefill = histogram("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
                                 latency)
        self.decode = histogram("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
                                latency)
        self.num_preemptions = histogram("vllm:request_num_preemptions", "Histogram of the number of times a request was preempted.",
                                         b("request_num_preemptions"))
        self.prefill_kv_computed = histogram(
            "vllm:request_prefill_kv_computed_tokens", "Histogram of new KV tokens computed during prefill (excluding cached tokens).", tokens
        )

    def observe_step(self, outputs: StepTokens) -> None:
        """The latencies one executed step completed, and the requests it ended."""
        if not outputs.requests:
            return
        now = outputs.time
        # NOTE: the requests of a decode step mostly got their previous token in the
        # same step, so their gaps are a handful of distinct values: each is observed
        # once with its count, not once per request.
        gaps = Tally(outputs.prev_token_times)
        num_computed_prompt_tokens = 0
        if gaps.pop(None, 0):
            for i, prev in enumerate(outputs.prev_token_times):
                if prev is None:
                    request = outputs.requests[i]
                    self.ttft.observe(now - request.arrival_time)
                    num_computed_prompt_tokens += request.num_prompt_tokens - request.num_cached_tokens
        for prev, count in gaps.items():
            observe_repeated(self.itl, now - prev, count)
        # As vLLM: the step's computed prompt tokens (at first tokens) and its new tokens.
        self.iteration_tokens.observe(num_computed_prompt_tokens + len(outputs.requests))
        for i in outputs.finish_reasons:
            self.observe_finished(outputs.requests[i], now)

    def observe_finished(self, request: Request, now: float) -> None:
        """A finished request's phases and counts (one that has its first token)."""
        scheduled, first, last = request.scheduled_time, request.first_token_time, request.last_token_time
        decode = last - first
        num_output_tokens = request.num_output_tokens
        self.e2e.observe(now - request.arrival_time)
        self.queue.observe(scheduled - request.arrival_time)
        self.prefill.observe(first - scheduled)
        self.inference.observe(last - scheduled)
        self.decode.observe(decode)
        self.num_preemptions.observe(request.num_preemptions)
        self.prefill_kv_computed.observe(request.num_prompt_tokens - max(request.num_cached_tokens, 0))
        self.tpot.observe(decode / (num_output_tokens - 1) if num_output_tokens > 1 else 0)


def observe_repeated(histogram: Histogram, value: float, count: int) -> None:
    """``histogram.observe(value)``, ``count`` times, at the cost of one.

    NOTE: prometheus_client's Histogram has no count argument; this does what its
    observe does (the sum, and one bucket: the first whose bound is >= value)
    through its internals, and falls back to observe() should they change. A test
    holds it to observe()."""
    try:
        buckets, bounds, total = histogram._buckets, histogram._upper_bounds, histogram._sum
    except AttributeError:
        for _ in range(count):
            histogram.observe(value)
        return
    total.inc(value * count)
    buckets[bisect_left(bounds, value)].inc(count)


def observe_many(histogram: Histogram, values: list[float]) -> None:
    """``histogram.observe(v)`` for every value, one increment per bucket touched.

    NOTE: as `observe_repeated`, through prometheus_client's internals (the sum, and
    for each value the first bucket whose bound is >= it), falling back to observe()."""
    if not values:
        return
    try:
        buckets, bounds, total = histogram._buckets, histogram._upper_bounds, histogram._sum
    except AttributeError:
        for value in values:
            histogram.observe(value)
        return
    total.inc(sum(values))
    for index, count in Tally(bisect_left(bounds, value) for value in values).items():
        buckets[index].inc(count)
