"""PrefixCacheStats: the prefix cache's cumulative counters, as vLLM's."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class PrefixCacheStats:
    """Cumulative prefix-cache counters, in tokens, as vLLM's PrefixCacheStats.

    ``requests/queries/hits`` count first admissions only (vllm:prefix_cache_queries
    and _hits); a request resumed after preemption is counted apart, in the
    ``preempted_*`` fields. NOTE: a victim re-admitted hits its own freed blocks,
    so counting it again would raise the hit rate exactly when the pool is too
    small."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits

    @property
    def hit_rate(self) -> float:
        """Of first admissions: hits / queries (0.0 before any query)."""
        return self.hits / self.queries if self.queries else 0.0

    @property
    def preempted_hit_rate(self) -> float:
        return self.preempted_hits / self.preempted_queries if self.preempted_queries else 0.0
