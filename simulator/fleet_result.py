"""What one fleet run yields (simulator/fleet.py): a table row and a --result-json
entry, with each replica's figures."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class FleetResult:
    """One fleet run's figures (a table row, a --result-json entry)."""

    replicas: int
    router: str
    num_blocks: int  # per replica
    policy: str
    max_concurrency: int | None
    aggregate_hit_rate: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    requests_imbalance: float  # max / mean requests routed to a replica
    tokens_imbalance: float  # max / mean prompt tokens routed to a replica
    mean_queueing_delay_ms: float
    p50_queueing_delay_ms: float
    p90_queueing_delay_ms: float
    p99_queueing_delay_ms: float
    mean_ttft_ms: float
    # Latency as `vllm bench serve` reports it (simulator/token_times.py), from the engine's arrival.
    p50_ttft_ms: float
    p99_ttft_ms: float
    p50_tpot_ms: float
    p99_tpot_ms: float
    p50_itl_ms: float
    p99_itl_ms: float
    num_output_tokens: int
    output_tokens_per_s: float
    num_requests: int
    num_finished: int
    num_rejected: int
    num_evictions: int
    num_preemptions: int
    simulated_s: float
    wall_s: float
    cpu_s: float  # this process's CPU time for the run (the machine may be shared)
    per_replica: list[dict] = field(default_factory=list)
    router_decisions: dict = field(default_factory=dict)
    # Speculative decoding's counts over all replicas (simulator/spec_decode.py); empty when off.
    spec_decode: dict = field(default_factory=dict)
    # A P/D fleet (simulator/pd_fleet.py): "P:D" and each pool's and the transfers' figures; "" and {} otherwise.
    pd: str = ""
    pd_pools: dict = field(default_factory=dict)

    def summary(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}
