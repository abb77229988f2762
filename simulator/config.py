"""One simulated engine's settings (`SimConfig`): the pool, the policy, the step's cost in
virtual time, and each feature the simulator models (host and external tiers, pins,
hybrid groups, speculative decoding); simulator/engine.py runs them."""

from __future__ import annotations

from dataclasses import dataclass

from protocol.kv_cache_spec import DEFAULT_BLOCK_SIZE
from simulator.external_io import EXTERNAL_TIER_SPEEDS, TierSpeeds
from simulator.spec_decode import DEFAULT_ACCEPTANCE_RATE


@dataclass(frozen=True, slots=True)
class SimConfig:
    num_blocks: int
    block_size: int = DEFAULT_BLOCK_SIZE
    policy: str = "vllm"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 131072
    step_overhead_ms: float = 5.0
    ms_per_token: float = 0.02
    hash_algo: str = "xxhash"
    fast_forward: bool = True
    # The host tier (scheduler/core/offload/offload_tier.py): slots, when blocks go there
    # ("eviction" or write-through "full"), the bandwidth a load is charged at, and
    # the KV bytes of one token over all layers (bytes moved, `block_bytes`; the default is
    # a Llama-3-8B in bfloat16: 2 x 32 layers x 8 KV heads x 128 dims x 2 bytes).
    num_host_blocks: int = 0
    offload_store: str = "eviction"
    offload_bandwidth_gbps: float = 25.0
    kv_bytes_per_token: int = 131072
    # vLLM 0.32's scheduler_reserve_full_isl (scheduler/sched/scheduler.py).
    reserve_full_sequence: bool = True
    # vLLM 0.32's scheduling-policy options (scheduler/sched/policy_options.py).
    scheduling_policy: str = "fcfs"
    long_prefill_token_threshold: int = 0
    long_prefill_token_threshold_adaptive: bool = False
    enable_chunked_prefill: bool = True
    watermark: float = 0.0
    max_num_scheduled_tokens: int | None = None  # None: max_num_batched_tokens
    max_num_active_seqs: int | None = None  # None: max_num_seqs
    # The device pool's eviction policy (scheduler/core/retention/eviction_policies.py), as --kv-eviction-policy.
    eviction_policy: str = "lru"
    # Pin the first this many tokens (whole blocks) of the first request to arrive
    # before the replay, as POST /v1/cache/pin would (the server's --max-pinned-fraction cap).
    pin_prefix_tokens: int = 0
    max_pinned_fraction: float = 0.5
    # Hybrid KV-cache groups' windows (simulator/layer_windows.py); (): one full-attention group.
    group_windows: tuple[int, ...] = ()
    # Speculative decoding (simulator/spec_decode.py): drafts a decoding step (0: off),
    # each accepted with this probability until the first rejection, drawn from this seed.
    num_speculative_tokens: int = 0
    spec_acceptance_rate: float = DEFAULT_ACCEPTANCE_RATE
    spec_seed: int = 0
    # The external tier (simulator/external_io.py): "none", "disk" or "store"; its capacity in
    # blocks (0: unbounded); read and write GB/s and per-load latency (None: the tier's
    # defaults, EXTERNAL_TIER_SPEEDS); replay once to fill it before the measured replay.
    external_tier: str = "none"
    external_tier_blocks: int = 0
    external_read_gbps: float | None = None
    external_write_gbps: float | None = None
    external_latency_ms: float | None = None
    external_warm: bool = False
    # Hybrid groups' layers: the model's, and those one block spans (protocol.kv_cache_spec's
    # num_kv_tensors); 0: every layer (one group). A tier moves one group's block at a time,
    # so a block's bytes are kv_bytes_per_token's share of those layers (`block_bytes`).
    num_layers: int = 0
    num_block_layers: int = 0

    def block_bytes(self) -> int:
        """The KV bytes of one block of one KV-cache group: ``block_size`` tokens of the
        ``num_block_layers`` layers it spans, ``kv_bytes_per_token`` being every layer's."""
        if not self.num_layers:
            return self.kv_bytes_per_token * self.block_size
        return round(self.kv_bytes_per_token * self.block_size * self.num_block_layers / self.num_layers)

    def external_speeds(self) -> TierSpeeds:
        """The external tier's speeds: those given, the tier's defaults for the others."""
        d = EXTERNAL_TIER_SPEEDS[self.external_tier]
        pick = lambda given, default: default if given is None else given  # noqa: E731
        return TierSpeeds(pick(self.external_read_gbps, d.read_gbps), pick(self.external_write_gbps, d.write_gbps),
                          pick(self.external_latency_ms, d.latency_ms))
