"""What one P/D fleet run (simulator/pd_fleet.py) yields: a `FleetResult` like any fleet's,
its pools' and the transfers' figures in ``pd_pools``.

The fleet-wide figures are the client's (latency from the decode engines' tokens, the
requests finished and refused), the prompt's (hit rate, imbalance and queueing over the
prefill pool, which computes the prompts), or sums over every engine (evictions,
preemptions). A decode engine's hits are prompt blocks it did not have to read.
"""

from __future__ import annotations

import time

from scheduler.core.kv_cache_usage import get_peak_usage
from simulator.fleet_result import FleetResult
from simulator.result import NOT_YET
from simulator.token_times import percentile


def _engine_figures(e, specs, simulated_ns: int) -> dict:
    run = e.run
    stats = run.kv.prefix_cache_stats
    return {"pool": e.pool, "replica": e.index, "requests": e.routed, "prompt_tokens": e.routed_tokens,
            "hit_rate": stats.hit_rate, "prefix_cache_hits": stats.hits, "prefix_cache_queries": stats.queries,
            "evictions": run.kv.block_pool.num_evictions, "preemptions": run.sched.num_preemptions,
            "rejected": run.num_rejected, "peak_usage": get_peak_usage(run.kv), "end_usage": run.kv.usage,
            "peak_running": e.peak_running, "busy_s": e.busy_ns / 1e9,
            "busy_share": e.busy_ns / simulated_ns if simulated_ns else 0.0}


def _transfer_figures(fleet) -> dict:
    links = [e.link for e in fleet.decode]
    num, blocks = sum(x.num_transfers for x in links), sum(x.num_blocks for x in links)
    return {"gbps": fleet.transfer[0], "latency_ms": fleet.transfer[1], "transfers": num, "blocks": blocks,
            "bytes": blocks * links[0].block_bytes, "busy_s": sum(x.busy_ns for x in links) / 1e9,
            "mean_wait_ms": sum(x.wait_ns for x in links) / num / 1e6 if num else 0.0}


def _imbalance(values: list[int]) -> float:
    mean = sum(values) / len(values)
    return max(values) / mean if mean else 1.0


def pd_result(fleet, wall_start: float, cpu_start: float) -> FleetResult:
    """The run's figures, ``wall_s`` and ``cpu_s`` counted from the given starts."""
    engines = [*fleet.prefill, *fleet.decode]
    simulated_ns = max(e.run.now for e in engines)
    specs, send = fleet.prefill_view.specs, fleet.send_ns
    hits = sum(e.run.kv.prefix_cache_stats.hits for e in fleet.prefill)
    queries = sum(e.run.kv.prefix_cache_stats.queries for e in fleet.prefill)
    delays = [e.run.admit_ns[i] - send[i] for e in fleet.prefill for i in e.run.order if e.run.admit_ns[i] != NOT_YET]
    per = [_engine_figures(e, specs, simulated_ns) for e in engines]
    latency = fleet.tokens.figures(send)
    ttfts = [fleet.tokens.first_ns[i] - send[i] for i in range(len(send)) if fleet.tokens.first_ns[i] != NOT_YET]
    return FleetResult(
        replicas=len(engines), router=fleet.prefill_router.name, num_blocks=fleet.cfg.num_blocks, policy=fleet.cfg.policy,
        max_concurrency=fleet.max_concurrency, aggregate_hit_rate=hits / queries if queries else 0.0,
        prefix_cache_queries=queries, prefix_cache_hits=hits,
        requests_imbalance=_imbalance([e.routed for e in fleet.prefill]),
        tokens_imbalance=_imbalance([e.routed_tokens for e in fleet.prefill]),
        mean_queueing_delay_ms=sum(delays) / len(delays) / 1e6 if delays else 0.0,
        p50_queueing_delay_ms=percentile(delays, 0.5) / 1e6, p90_queueing_delay_ms=percentile(delays, 0.9) / 1e6,
        p99_queueing_delay_ms=percentile(delays, 0.99) / 1e6,
        mean_ttft_ms=sum(ttfts) / len(ttfts) / 1e6 if ttfts else 0.0,
        num_requests=len(send), num_finished=sum(len(e.run.finished_seq_ids) for e in fleet.decode),
        num_rejected=sum(e.run.num_rejected for e in engines),
        num_evictions=sum(e.run.kv.block_pool.num_evictions for e in engines),
        num_preemptions=sum(e.run.sched.num_preemptions for e in engines),
        simulated_s=simulated_ns / 1e9, wall_s=time.perf_counter() - wall_start, cpu_s=time.process_time() - cpu_start,
        per_replica=per, **latency, pd=f"{len(fleet.prefill)}:{len(fleet.decode)}",
        pd_pools={"prefill": [p for p in per if p["pool"] == "prefill"], "decode": [p for p in per if p["pool"] == "decode"],
                  "transfer": _transfer_figures(fleet)},
    )
