"""What a simulator run is, from its flags (simulator/cli.py, simulator/fleet_cli.py): the
workload and each engine's configuration, and the comma lists its flags take. Both command
lines read them from here, so neither imports the other's internals."""

from __future__ import annotations

import argparse
import dataclasses
import random

from protocol.kv_cache_spec import num_kv_tensors
from simulator.config import SimConfig
from simulator.spec_decode import DEFAULT_ACCEPTANCE_RATE
from simulator.workload import SampleWorkload, TraceWorkload, Workload


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one value")
    return values


def build_workload(a: argparse.Namespace) -> Workload:
    workload = _build_workload(a)
    if a.priority_levels > 1:
        rng = random.Random(a.seed)
        workload.specs = [dataclasses.replace(s, priority=rng.randrange(a.priority_levels)) for s in workload.specs]
    return workload


def _build_workload(a: argparse.Namespace) -> Workload:
    # NOTE: loadgen imports are here so that the scheduler package loads without them.
    from loadgen.arrivals import arrival_offsets
    from loadgen.datasets import load_mooncake_trace, random_requests, shared_prefix_requests

    if a.dataset == "mooncake":
        records = load_mooncake_trace(a.trace)
        if a.num_requests is not None:
            records = records[: a.num_requests]
        return TraceWorkload(records, a.time_scale, a.vocab_size, a.max_input_len)
    num = 200 if a.num_requests is None else a.num_requests
    if a.dataset == "shared-prefix":
        samples = shared_prefix_requests(num, a.num_prefixes, a.prefix_len, a.suffix_len, a.output_len, a.vocab_size, a.seed)
    else:
        samples = random_requests(num, a.input_len, a.output_len, a.range_ratio, a.vocab_size, a.seed)
    return SampleWorkload(samples, arrival_offsets(num, a.request_rate, a.burstiness, a.seed).tolist(), a.vocab_size)


def _spec_rate(a: argparse.Namespace) -> float:
    rate = getattr(a, "spec_acceptance_rate", None)
    return DEFAULT_ACCEPTANCE_RATE if rate is None else rate


def _group_layers(a: argparse.Namespace) -> dict:
    """The model's layers and those one block spans, with KV-cache groups from the flags (none: {})."""
    groups = getattr(a, "groups", None)
    if not groups:
        return {}
    return {"num_layers": sum(len(g.layer_ids) for g in groups), "num_block_layers": num_kv_tensors(groups)}


def sim_config(a: argparse.Namespace, num_blocks: int, num_host_blocks: int, policy: str, eviction: str = "lru",
               num_external_blocks: int = 0) -> SimConfig:
    """One engine's configuration from the flags (the fleet's replicas share it)."""
    cfg = SimConfig(
        num_blocks, a.block_size, policy, a.max_num_seqs, a.max_num_batched_tokens, a.max_model_len,
        a.step_overhead_ms, a.ms_per_token, a.prefix_caching_hash_algo, a.fast_forward,
        num_host_blocks, a.kv_offloading_store, a.offload_bandwidth_gbps, a.kv_bytes_per_token,
        a.scheduler_reserve_full_isl, a.scheduling_policy, a.long_prefill_token_threshold,
        a.long_prefill_token_threshold_adaptive, a.enable_chunked_prefill, a.watermark, a.max_num_scheduled_tokens,
        a.max_num_active_seqs, eviction, a.pin_prefix_tokens, a.max_pinned_fraction, getattr(a, "group_windows", ()),
        getattr(a, "num_speculative_tokens", 0), _spec_rate(a), a.seed, **_group_layers(a),
    )
    tier = getattr(a, "external_tier", "none")
    if tier == "none":
        return cfg
    return dataclasses.replace(cfg, external_tier=tier, external_tier_blocks=num_external_blocks, external_read_gbps=a.external_read_gbps,
                               external_write_gbps=a.external_write_gbps, external_latency_ms=a.external_latency_ms,
                               external_warm=a.external_tier_warm)
