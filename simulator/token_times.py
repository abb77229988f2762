"""When each request's output tokens reach its client, for a fleet's latency figures:
TTFT, TPOT and ITL percentiles and output tokens per second, as ``vllm bench serve``
reports them.

A step's tokens are out at its end; a fast-forwarded stretch of k decode steps of
``step_ns`` gives each running request one token every ``step_ns``. ITL is the gap
between a request's successive token deliveries (tokens of one step arrive together,
one gap), TPOT a request's (last token - first token) / (output tokens - 1). The gaps
are kept as a histogram (gap ns -> count): a long run has tens of millions of them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from simulator.result import NOT_YET


def percentile(values: Sequence[int], q: float) -> float:
    """The value at quantile ``q`` of ``values`` (0.0 when empty), as the fleet's other percentiles."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])


def _histogram_percentile(counts: Counter, q: float) -> float:
    total = sum(counts.values())
    if not total:
        return 0.0
    rank, seen = min(total - 1, int(q * total)), 0
    for value in sorted(counts):
        seen += counts[value]
        if seen > rank:
            return float(value)
    raise AssertionError("unreachable")


class TokenTimes:
    """Token deliveries of ``n`` requests (by seq_id), noted step by step."""

    __slots__ = ("first_ns", "last_ns", "num_tokens", "gaps")

    def __init__(self, n: int):
        self.first_ns = [NOT_YET] * n
        self.last_ns = [NOT_YET] * n
        self.num_tokens = [0] * n
        self.gaps: Counter[int] = Counter()

    @staticmethod
    def counts(requests: Iterable) -> list[tuple[object, int]]:
        """Each request with its output tokens so far (taken before a step)."""
        return [(r, r.num_output_tokens) for r in requests]

    def note(self, before: list[tuple[object, int]], start_ns: int, step_ns: int, num_steps: int = 1) -> None:
        """The requests of ``before`` got their new tokens in ``num_steps`` steps of
        ``step_ns`` from ``start_ns``: one step's all at its end; a fast-forwarded
        stretch's one a step."""
        first, last, counts, gaps = self.first_ns, self.last_ns, self.num_tokens, self.gaps
        for r, had in before:
            got = r.num_output_tokens - had
            if got <= 0:
                continue
            i = r.seq_id
            t = start_ns + step_ns
            if last[i] == NOT_YET:
                first[i] = t
            else:
                gaps[t - last[i]] += 1
            if num_steps > 1:
                gaps[step_ns] += num_steps - 1
            last[i] = start_ns + num_steps * step_ns
            counts[i] += got

    def run_step(self, run, out) -> tuple[int, int, bool]:
        """``run.step(out)`` (simulator/engine.py), its tokens noted."""
        before, start = self.counts(out.scheduled), run.now
        result = run.step(out)
        self.note(before, start, result[0])
        return result

    def run_fast_forward(self, run, step_ns: int) -> None:
        """``run.fast_forward(step_ns)``, its stretch's tokens noted (a fleet's engines stage nothing,
        so the stretch is whole steps)."""
        before, start = self.counts(run.sched.running), run.now
        run.fast_forward(step_ns)
        if run.now > start:
            self.note(before, start, step_ns, (run.now - start) // step_ns)

    def figures(self, send_ns: Sequence[int]) -> dict:
        """TTFT (from each request's send), TPOT and ITL percentiles in ms, and output
        tokens per second from the first send to the last token."""
        n = len(send_ns)
        done = [i for i in range(n) if self.first_ns[i] != NOT_YET]
        ttfts = [self.first_ns[i] - send_ns[i] for i in done]
        tpots = [(self.last_ns[i] - self.first_ns[i]) / (self.num_tokens[i] - 1) for i in done if self.num_tokens[i] > 1]
        span = max((self.last_ns[i] for i in done), default=0) - min(send_ns, default=0)
        ms = lambda ns: ns / 1e6  # noqa: E731
        return dict(
            p50_ttft_ms=ms(percentile(ttfts, 0.5)), p99_ttft_ms=ms(percentile(ttfts, 0.99)),
            p50_tpot_ms=ms(percentile(tpots, 0.5)), p99_tpot_ms=ms(percentile(tpots, 0.99)),
            p50_itl_ms=ms(_histogram_percentile(self.gaps, 0.5)), p99_itl_ms=ms(_histogram_percentile(self.gaps, 0.99)),
            num_output_tokens=sum(self.num_tokens),
            output_tokens_per_s=sum(self.num_tokens) / (span / 1e9) if span > 0 else 0.0,
        )
