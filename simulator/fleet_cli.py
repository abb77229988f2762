"""The simulator's fleet mode: ``--replicas N --router POLICY`` (simulator/fleet.py).

Every combination of --replicas, --router, --num-blocks (a replica's), --policy and
--kv-offloading-blocks is one run; runs go to ``--jobs`` processes at once, each
building the workload once. The table has a row a run: aggregate hit rate (hits over
looked-up tokens, summed over the replicas), imbalance (max / mean requests and
prompt tokens a replica), queueing (first admission - send, mean and percentiles);
``--result-json`` adds each replica's figures.

    python -m simulator --trace conversation_trace.jsonl --num-blocks 20000 \\
        --replicas 4,8,16 --router round_robin,cache_aware,kv_aware --jobs 8 --result-json fleet.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from simulator.routers import ROUTERS
from simulator.run_setup import build_workload, int_list, sim_config

FLEET_COLUMNS = (
    ("replicas", "replicas", "d"), ("router", "router", "s"), ("num_blocks", "blocks", "d"),
    ("aggregate_hit_rate", "hit rate", ".2%"), ("requests_imbalance", "req max/mean", ".2f"),
    ("tokens_imbalance", "tok max/mean", ".2f"), ("mean_queueing_delay_ms", "mean queue ms", ".1f"),
    ("p50_queueing_delay_ms", "p50 queue ms", ".1f"), ("p99_queueing_delay_ms", "p99 queue ms", ".1f"),
    ("p50_ttft_ms", "p50 TTFT ms", ".1f"), ("p99_ttft_ms", "p99 TTFT ms", ".1f"), ("p50_tpot_ms", "p50 TPOT ms", ".2f"),
    ("p99_tpot_ms", "p99 TPOT ms", ".2f"), ("p50_itl_ms", "p50 ITL ms", ".2f"), ("p99_itl_ms", "p99 ITL ms", ".2f"),
    ("output_tokens_per_s", "out tok/s", ".0f"),
    ("num_evictions", "evictions", "d"), ("num_preemptions", "preemptions", "d"), ("wall_s", "wall s", ".1f"), ("cpu_s", "cpu s", ".1f"),
)


def _router_list(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in values if v not in ROUTERS]
    if bad or not values:
        raise argparse.ArgumentTypeError(f"unknown router {', '.join(bad) or text!r}; choose from {', '.join(ROUTERS)}")
    return values


def _request_path(text: str) -> tuple[float, float, float]:
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 3 or not all(0 <= v < math.inf for v in values):
        raise argparse.ArgumentTypeError(f"expected DECIDE,THERE,BACK: three milliseconds >= 0, got {text!r}")
    return values  # type: ignore[return-value]


def add_fleet_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("fleet (replicas behind vllm-router's policies)")
    g.add_argument("--replicas", type=int_list, default=None, metavar="N",
                   help="simulate N replicas behind a router; a comma list runs each (default: one engine, no router)")
    g.add_argument("--router", type=_router_list, default=None,
                   help=f"routing policy, or a comma list: {', '.join(ROUTERS)} (default cache_aware, vllm-router's)")
    g.add_argument("--max-concurrency", type=int, default=None,
                   help="closed loop: at most this many requests in flight, the next sent when one finishes (default: no limit)")
    g.add_argument("--non-streaming", action="store_true",
                   help="the clients do not stream: kv_aware counts a request as prefilling until it finishes, "
                        "not until its first token (default: streamed, as the load generator sends)")
    g.add_argument("--request-path-ms", type=_request_path, default=None, metavar="DECIDE,THERE,BACK",
                   help="a request's milliseconds outside the engines: from its send to the router's decision (the "
                        "router's own work, kv_aware's render call), from there to the engine, and from the engine's "
                        "token back to the router and client (default 0,0,0)")
    g.add_argument("--request-path-jitter", type=float, default=None, metavar="J",
                   help="with --request-path-ms: each request's three times drawn apart, uniform within (1 - J, 1 + J) "
                        "x the given ones, from --seed (default 0: every request the same)")
    g.add_argument("--jobs", type=int, default=None, help="runs at once, in processes (default: the CPU count)")


def check_fleet_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Fleet runs: --replicas N, or --pd P:D (simulator/pd_args.py checks its own flags)."""
    if a.replicas is None and a.pd is None:
        for flag, value in (("--router", a.router), ("--max-concurrency", a.max_concurrency), ("--jobs", a.jobs),
                            ("--non-streaming", a.non_streaming or None), ("--request-path-ms", a.request_path_ms),
                            ("--request-path-jitter", a.request_path_jitter)):
            if value is not None:
                p.error(f"{flag} applies to fleet runs: give --replicas N")
        return
    if a.router is None:
        a.router = ["cache_aware"]
    if any(n < 1 for n in a.replicas or ()):
        p.error(f"--replicas must be positive, got {min(a.replicas)}")
    if a.max_concurrency is not None and a.max_concurrency < 1:
        p.error(f"--max-concurrency must be >= 1, got {a.max_concurrency}")
    if a.request_path_jitter is not None:
        if a.request_path_ms is None:
            p.error("--request-path-jitter needs --request-path-ms")
        if not 0 <= a.request_path_jitter < 1:
            p.error(f"--request-path-jitter must be in [0, 1), got {a.request_path_jitter}")
    if a.jobs is not None and a.jobs < 1:
        p.error(f"--jobs must be >= 1, got {a.jobs}")
    if a.plot is not None:
        p.error("--plot draws single-engine runs; a fleet run has --result-json")
    if len(a.kv_eviction_policy) > 1:
        p.error("a fleet run takes one --kv-eviction-policy (its replicas share it), not a list")


_WORKLOAD = None


def _run_one(a: argparse.Namespace, num_blocks: int, num_host_blocks: int, policy: str, layout: int | tuple[int, int], router: str) -> dict:
    """One fleet run in a worker process (the workload built once a process); ``layout``:
    N replicas, or (P, D) prefill and decode engines."""
    global _WORKLOAD
    from simulator.fleet import simulate_fleet
    from simulator.fleet_requests import RequestPaths
    from simulator.pd_fleet import simulate_pd_fleet

    if _WORKLOAD is None:
        _WORKLOAD = build_workload(a)
    cfg = sim_config(a, num_blocks, num_host_blocks, policy, a.kv_eviction_policy[0])
    if isinstance(layout, tuple):
        return simulate_pd_fleet(_WORKLOAD, cfg, *layout, router, a.transfer_gbps, a.transfer_latency_ms, a.max_concurrency, a.seed).summary()
    replicas = layout
    paths = RequestPaths.from_ms(*a.request_path_ms, a.request_path_jitter or 0.0, a.seed) if a.request_path_ms else None
    return simulate_fleet(_WORKLOAD, cfg, replicas, router, a.max_concurrency, a.seed, not a.non_streaming, paths).summary()


def format_fleet_table(rows: list[dict]) -> str:
    table = [[h for _, h, _ in FLEET_COLUMNS]]
    table += [[_pd_layout(r) if k == "replicas" and r["pd"] else format(r[k], spec) for k, _, spec in FLEET_COLUMNS] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(FLEET_COLUMNS))]
    lines = ["  ".join(c.ljust(w) if i == 1 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))) for row in table]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def _pd_layout(row: dict) -> str:
    p, d = row["pd"].split(":")
    return f"{p}P{d}D"


def _pd_line(row: dict) -> str:
    """A P/D run's pools: usage, busy share, peak running, and the link's bytes and seconds."""
    pools = row["pd_pools"]
    parts = [f"{_pd_layout(row)}, {row['router']}, {row['num_blocks']} blocks:"]
    for pool in ("prefill", "decode"):
        engines = pools[pool]
        parts.append(f"{pool} peak usage {max(e['peak_usage'] for e in engines):.1%}, busy "
                     f"{sum(e['busy_share'] for e in engines) / len(engines):.0%}, peak running {max(e['peak_running'] for e in engines)};")
    x = pools["transfer"]
    parts.append(f"transfers {x['transfers']} ({x['blocks']} blocks, {x['bytes'] / 1e9:.2f} GB at {x['gbps']:g} GB/s: "
                 f"{x['busy_s']:.2f} s busy, mean {x['mean_wait_ms']:.1f} ms queued to read)")
    return " ".join(parts)


def fleet_main(a: argparse.Namespace, workload, source: str) -> int:
    layouts = [*(a.replicas or ()), *(a.pd or ())]
    runs = [(n, h, pol, lay, rt) for n in a.num_blocks for h in a.kv_offloading_blocks for pol in a.policy
            for lay in layouts for rt in a.router]
    jobs = min(len(runs), a.jobs or os.cpu_count() or 1)
    print(f"  {len(runs)} fleet runs, {jobs} at once", file=sys.stderr)
    if jobs == 1:
        global _WORKLOAD
        _WORKLOAD = workload
        rows = [_run_one(a, *run) for run in runs]
    else:
        with ProcessPoolExecutor(jobs) as pool:
            rows = list(pool.map(_run_one, [a] * len(runs), *zip(*runs, strict=True)))
    for r in rows:
        per = " ".join(f"{p['hit_rate']:.0%}" for p in r["per_replica"])
        print(f"  {_pd_layout(r) if r['pd'] else r['replicas']} x {r['num_blocks']} blocks, {r['router']}: hit rate {r['aggregate_hit_rate']:.2%} "
              f"(replicas: {per}) ({r['wall_s']:.1f} s)", file=sys.stderr)
    print(format_fleet_table(rows))
    for r in rows:
        if r["pd"]:
            print(_pd_line(r))
    if a.result_json:
        config = {k: (str(v) if isinstance(v, float) and math.isinf(v) else v) for k, v in vars(a).items()}
        doc = {"source": source, "config": {k: v for k, v in config.items() if k not in ("result_json", "plot")}, "results": rows}
        Path(a.result_json).write_text(json.dumps(doc, indent=2, default=str) + "\n", encoding="utf-8")
    return 0
