"""What one simulation yields: its figures (the table's row, ``--result-json``'s) and,
for tests, each request's times in virtual ns.

Made from a finished run (simulator/replay.py's run_result); read by the table
(simulator/table.py) and the plot (simulator/plot.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

NOT_YET = -1


@dataclass(slots=True)
class SimResult:
    """One run's figures (what the table and --result-json show), plus per-request
    times in virtual ns (NOT_YET where it never happened) for tests."""

    num_blocks: int
    policy: str
    # First admissions only, as vllm:prefix_cache_queries/_hits count them.
    prefix_cache_hit_rate: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    # Re-admissions of preempted requests (they hit their own freed blocks), apart.
    prefix_cache_preempted_hit_rate: float
    prefix_cache_preempted_queries: int
    prefix_cache_preempted_hits: int
    num_evictions: int
    num_preemptions: int
    num_rejected: int
    num_requests: int
    num_finished: int
    peak_usage: float
    mean_queueing_delay_ms: float
    p99_queueing_delay_ms: float
    mean_ttft_ms: float
    simulated_s: float
    num_steps: int
    num_fast_forwarded_steps: int
    wall_s: float
    # The host tier (zeros without one). host_hit_rate: host hits over all looked-up
    # tokens, so prefix_cache_hit_rate + host_hit_rate = combined_hit_rate;
    # external_prefix_cache_hit_rate is vLLM's: host hits over the tokens the device
    # did not hold (vllm:external_prefix_cache_hits / _queries).
    num_host_blocks: int = 0
    host_hit_rate: float = 0.0
    combined_hit_rate: float = 0.0
    external_prefix_cache_hit_rate: float = 0.0
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    num_host_stores: int = 0
    num_host_loads: int = 0
    num_host_stores_skipped: int = 0
    num_host_evictions: int = 0
    bytes_stored: int = 0
    bytes_loaded: int = 0
    load_time_s: float = 0.0
    # The device pool's eviction policy (--kv-eviction-policy).
    eviction_policy: str = "lru"
    # Blocks pinned (--pin-prefix-tokens) at the end of the run.
    num_pinned_blocks: int = 0
    # Speculative decoding (--num-speculative-tokens K; zeros when off), as vLLM's
    # SpecDecodingLogging: drafts (one per request per step that verified some), draft
    # tokens, accepted tokens; draft acceptance rate = accepted / draft tokens; mean
    # acceptance length = 1 + accepted / drafts (tokens a verifying step yields a request);
    # per position i: the share of drafts whose i-th token was accepted.
    num_speculative_tokens: int = 0
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_draft_acceptance_rate: float = 0.0
    spec_mean_acceptance_length: float = 0.0
    spec_acceptance_rate_per_position: list[float] = field(default_factory=list)
    # The external tier (--external-tier disk|store; "none", and these figures left out of
    # summary(), without one). Its hit rate: tokens its loads brought at first admissions
    # over all looked-up tokens, so the device's + the host tier's + this = combined_hit_rate.
    # Blocks loaded are those read whole (a load stops at a block the store no longer
    # holds: a failure, computed again). Times: the I/O thread's seconds saving and
    # loading; stage: the device-to-host copies of the saves, charged in their steps; mean
    # load: queued to reported (waits behind earlier saves included); backlog: the
    # queued I/O a plan's ops found (peak) and left at the end (write bandwidth short of
    # the saves shows there).
    external_tier: str = "none"
    external_tier_blocks: int = 0  # capacity (0: unbounded)
    external_tier_warm: bool = False
    external_tier_warm_blocks: int = 0  # held when the measured replay began
    external_tier_hit_rate: float = 0.0
    external_tier_hit_tokens: int = 0
    external_tier_preempted_hit_tokens: int = 0
    external_tier_loads: int = 0
    external_tier_blocks_loaded: int = 0
    external_tier_load_failures: int = 0
    external_tier_blocks_saved: int = 0
    external_tier_saves_skipped: int = 0
    external_tier_evictions: int = 0
    external_tier_bytes_read: int = 0
    external_tier_bytes_written: int = 0
    external_tier_mean_load_ms: float = 0.0
    external_tier_stage_s: float = 0.0
    external_tier_save_s: float = 0.0
    external_tier_load_s: float = 0.0
    external_tier_peak_backlog_s: float = 0.0
    external_tier_end_backlog_s: float = 0.0
    admit_ns: list[int] = field(default_factory=list, repr=False)
    first_token_ns: list[int] = field(default_factory=list, repr=False)
    finish_ns: list[int] = field(default_factory=list, repr=False)

    def summary(self) -> dict:
        """The JSON row: every figure, no per-request lists; the spec-decode ones only
        with speculation, the external tier's only with one."""
        spec = self.num_speculative_tokens > 0
        external = self.external_tier != "none"
        return {k: getattr(self, k) for k in self.__slots__
                if not k.endswith("_ns") and (spec or not (k.startswith("spec_") or k == "num_speculative_tokens"))
                and (external or not k.startswith("external_tier"))}
