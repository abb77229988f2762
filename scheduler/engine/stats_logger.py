"""The engine's periodic stats line, as vLLM's `LoggingStatLogger` writes it.

Every ``--log-stats-interval`` seconds (vLLM: ``VLLM_LOG_STATS_INTERVAL``, 10 s) one
line through `logging`, worded as vLLM's so the same grep finds both::

    Engine 000: Avg prompt throughput: 1234.5 tokens/s, Avg generation throughput:
    67.8 tokens/s, Running: 8 reqs, Waiting: 0 reqs, GPU KV cache usage: 41.2%,
    Prefix cache hit rate: 83.0%

(one line; ``Preemptions: N`` before the KV usage when the interval had any). The
throughputs are the interval's (prompt tokens computed, cache hits left out, counted at
each request's first token, as vLLM's: ``vllm:prompt_tokens_by_source{source="local_compute"}``); the hit rate is over the most recent ~1,000 admitted
requests, as vLLM's ``CachingMetrics``. An interval with no tokens after one with none
is logged at DEBUG ("avoid log noise on an idle production system", as vLLM).

With --enable-logging-iteration-details (and the stats on), one more INFO line per
step, as vLLM's ``LoggingStatLogger._log_iteration_details`` (`IterationDetailsLogger`)::

    Engine 000: Iteration(0): 2 context requests, 40 context tokens, 1 generation
    requests, 1 generation tokens, iteration elapsed time: 3.14 ms, GPU KV cache usage: 5.0%

With --speculative-config, after the stats line and at its level, vLLM's
``SpecDecodingLogging`` line when the interval had drafts (`SpecDecodingLogger`)::

    SpecDecoding metrics: Mean acceptance length: 3.00, Accepted throughput: 0.40
    tokens/s, Drafted throughput: 0.60 tokens/s, Accepted: 4 tokens, Drafted: 6 tokens,
    Per-position acceptance rate: 1.000, 0.500, 0.500, Avg Draft acceptance rate: 66.7%
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.engine.engine_state import EngineState
from scheduler.sched.outputs import SchedulerOutput
from scheduler.spec.spec_stats import SpecDecodingStats

log = logging.getLogger("scheduler")

# vLLM's CachingMetrics window: the hit rate of the last this-many requests.
MAX_RECENT_REQUESTS = 1000


@dataclass(frozen=True, slots=True)
class SpecSnapshot:
    """Speculative decoding's cumulative counters (`SpecDecodingStats`), copied."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_accepted_tokens_per_pos: tuple[int, ...]

    @classmethod
    def of(cls, stats: SpecDecodingStats) -> SpecSnapshot:
        per_pos = tuple(stats.num_accepted_tokens_per_pos)
        return cls(stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens, per_pos)


@dataclass(slots=True)
class StatsSnapshot:
    """The cumulative counters the line is made of, read at one instant."""

    prompt_tokens: int
    generation_tokens: int
    preemptions: int
    prefix_requests: int
    prefix_queries: int
    prefix_hits: int
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    spec: SpecSnapshot | None = None  # None without speculative decoding


def stats_snapshot(state: EngineState) -> StatsSnapshot | None:
    """The engine's counters now; None while there is no pool yet (no worker came)."""
    scheduler, kv = state.scheduler, state.kv
    if scheduler is None:
        return None
    p = kv.prefix_cache_stats
    spec = None if scheduler.spec_stats is None else SpecSnapshot.of(scheduler.spec_stats)
    return StatsSnapshot(
        scheduler.prompt_token_stats.computed, scheduler.num_generation_tokens, scheduler.num_preemptions, p.requests, p.queries,
        p.hits, scheduler.num_running, scheduler.num_waiting, kv.block_pool.get_usage(), spec,
    )


class StatsLogger:
    def __init__(self, engine_index: int, now: float):
        self.engine_index = engine_index
        self._last_time = now
        self._last: StatsSnapshot | None = None
        self._was_idle = True
        # (requests, queries, hits) of recent intervals, oldest first.
        self._recent: deque[tuple[int, int, int]] = deque()
        self.spec = SpecDecodingLogger(now)

    def log(self, snap: StatsSnapshot, now: float) -> str:
        """Log the interval since the previous call; returns the line (for tests)."""
        prev = self._last or StatsSnapshot(0, 0, 0, 0, 0, 0, 0, 0, 0.0)
        elapsed = max(now - self._last_time, 1e-9)
        prompt_tps = (snap.prompt_tokens - prev.prompt_tokens) / elapsed
        gen_tps = (snap.generation_tokens - prev.generation_tokens) / elapsed
        preemptions = snap.preemptions - prev.preemptions
        self._observe_prefix(snap.prefix_requests - prev.prefix_requests, snap.prefix_queries - prev.prefix_queries,
                             snap.prefix_hits - prev.prefix_hits)
        self._last, self._last_time = snap, now
        idle = prompt_tps == 0 and gen_tps == 0
        level = logging.DEBUG if idle and self._was_idle else logging.INFO
        self._was_idle = idle
        line = (
            f"Engine {self.engine_index:03d}: Avg prompt throughput: {prompt_tps:.1f} tokens/s, "
            f"Avg generation throughput: {gen_tps:.1f} tokens/s, Running: {snap.num_running} reqs, "
            f"Waiting: {snap.num_waiting} reqs, "
            + (f"Preemptions: {preemptions}, " if preemptions > 0 else "")
            + f"GPU KV cache usage: {snap.kv_cache_usage * 100:.1f}%, Prefix cache hit rate: {self.hit_rate * 100:.1f}%"
        )
        log.log(level, "%s", line)
        if snap.spec is not None:
            self.spec.log(snap.spec, now, level)
        return line

    def _observe_prefix(self, requests: int, queries: int, hits: int) -> None:
        if requests <= 0 and queries <= 0:
            return
        self._recent.append((requests, queries, hits))
        # NOTE: as vLLM's CachingMetrics: drop the oldest intervals while the rest
        # still cover the window, so the rate follows the recent workload.
        while len(self._recent) > 1 and sum(r for r, _, _ in self._recent) - self._recent[0][0] >= MAX_RECENT_REQUESTS:
            self._recent.popleft()

    @property
    def hit_rate(self) -> float:
        queries = sum(q for _, q, _ in self._recent)
        return sum(h for _, _, h in self._recent) / queries if queries else 0.0


class SpecDecodingLogger:
    """vLLM's SpecDecodingLogging line, from the deltas of the cumulative counters since
    the last line it logged. As vLLM's: nothing when no draft was verified since (its
    ``if not self.num_drafts: return``), and then its clock is not reset either, so the
    throughputs of the next line are over the whole time since the previous one."""

    __slots__ = ("_last", "_last_time")

    def __init__(self, now: float):
        self._last: SpecSnapshot | None = None
        self._last_time = now

    def log(self, snap: SpecSnapshot, now: float, level: int = logging.INFO) -> str | None:
        """Log the drafts since the previous line at ``level`` (the stats line's); returns
        the line (for tests), None when there were no drafts."""
        prev = self._last or SpecSnapshot(0, 0, 0, (0,) * len(snap.num_accepted_tokens_per_pos))
        num_drafts = snap.num_drafts - prev.num_drafts
        if num_drafts <= 0:
            return None
        draft_tokens = snap.num_draft_tokens - prev.num_draft_tokens
        accepted = snap.num_accepted_tokens - prev.num_accepted_tokens
        pairs = zip(snap.num_accepted_tokens_per_pos, prev.num_accepted_tokens_per_pos, strict=True)
        per_pos = [(n - p) / num_drafts for n, p in pairs]
        elapsed = now - self._last_time
        # NOTE: vLLM's 0 throughputs for no elapsed time, and its nan rate for drafts of 0 tokens.
        draft_tps = draft_tokens / elapsed if elapsed > 0 else 0.0
        accepted_tps = accepted / elapsed if elapsed > 0 else 0.0
        acceptance_rate = accepted / draft_tokens * 100 if draft_tokens > 0 else float("nan")
        self._last, self._last_time = snap, now
        line = (
            f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / num_drafts:.2f}, "  # the bonus token counted, as vLLM
            f"Accepted throughput: {accepted_tps:.2f} tokens/s, Drafted throughput: {draft_tps:.2f} tokens/s, "
            f"Accepted: {accepted} tokens, Drafted: {draft_tokens} tokens, "
            f"Per-position acceptance rate: {', '.join(f'{r:.3f}' for r in per_pos)}, "
            f"Avg Draft acceptance rate: {acceptance_rate:.1f}%"
        )
        log.log(level, "%s", line)
        return line


class IterationDetailsLogger:
    """One line per step, as vLLM's (``compute_iteration_details``, EngineCore's
    ``capture_iteration_details``): a scheduled request is a context request while it
    has no output token yet (a prompt, or a chunk of one; a request preempted after
    sampling recomputes as a generation request), its scheduled tokens counted with it;
    the elapsed time runs from the plan's sending to its result; the KV usage is read
    once the result is applied. ``enabled`` False: begin and end do nothing."""

    __slots__ = ("enabled", "engine_index", "iteration_index", "_counts", "_start")

    def __init__(self, enabled: bool, engine_index: int):
        self.enabled, self.engine_index = enabled, engine_index
        self.iteration_index = 0  # NOTE: counts the steps logged, as vLLM's _iteration_index
        self._counts = (0, 0, 0, 0)
        self._start = 0.0

    def begin(self, out: SchedulerOutput) -> None:
        """The step about to be sent (before its result changes any request)."""
        if not self.enabled:
            return
        num_scheduled = out.plan.num_scheduled_tokens
        ctx_reqs = ctx_tokens = gen_reqs = gen_tokens = 0
        for request in out.scheduled:
            n = num_scheduled.get(request.seq_id, 1)
            if request.num_output_tokens == 0:
                ctx_reqs, ctx_tokens = ctx_reqs + 1, ctx_tokens + n
            else:
                gen_reqs, gen_tokens = gen_reqs + 1, gen_tokens + n
        self._counts = (ctx_reqs, ctx_tokens, gen_reqs, gen_tokens)
        self._start = time.monotonic()

    def end(self, kv: KVCacheManager) -> str | None:
        """The step begun has its result applied: log its line; returns it (for tests)."""
        if not self.enabled:
            return None
        elapsed_ms = (time.monotonic() - self._start) * 1000
        line = (
            f"Engine {self.engine_index:03d}: Iteration({self.iteration_index}): {self._counts[0]} context requests, "
            f"{self._counts[1]} context tokens, {self._counts[2]} generation requests, {self._counts[3]} generation tokens, "
            f"iteration elapsed time: {elapsed_ms:.2f} ms, GPU KV cache usage: {kv.block_pool.get_usage() * 100:.1f}%"
        )
        self.iteration_index += 1
        log.info("%s", line)
        return line


async def log_stats_every(interval_s: float, engine_index: int, snapshot: Callable[[], StatsSnapshot | None]) -> None:
    """The stats line every ``interval_s`` until cancelled; ``snapshot`` is None while
    there is no pool yet (no worker came), and nothing is logged then."""
    stats = StatsLogger(engine_index, time.monotonic())
    while True:
        await asyncio.sleep(interval_s)
        snap = snapshot()
        if snap is not None:
            stats.log(snap, time.monotonic())
