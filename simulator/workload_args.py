"""The simulator's workload flags: a Mooncake trace or one of the load generator's synthetic
datasets, how many requests, their arrival and lengths (simulator/run_setup.py builds the
workload from them).

    python -m simulator --dataset shared-prefix --num-requests 500 --request-rate 20 --num-blocks 2000
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

DATASETS = ("mooncake", "shared-prefix", "random")


def add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--trace", default=None, help="Mooncake JSONL trace (implies --dataset mooncake)")
    g.add_argument("--dataset", choices=DATASETS, default=None, help="default: mooncake with --trace, else shared-prefix")
    g.add_argument("--num-requests", type=int, default=None, help="requests (default 200; trace: all)")
    g.add_argument("--time-scale", type=float, default=1.0, help="multiplies trace timestamps (0 = all at once)")
    g.add_argument("--max-input-len", type=int, default=None, help="cut longer trace prompts to this many tokens")
    g.add_argument("--request-rate", type=float, default=math.inf, help="datasets: req/s (Poisson/gamma); inf = all at t=0")
    g.add_argument("--burstiness", type=float, default=1.0, help="datasets: gamma shape of inter-arrival gaps")
    g.add_argument("--seed", type=int, default=0, help="seeds the datasets, --priority-levels and --spec-acceptance-rate's draws")
    g.add_argument("--vocab-size", type=int, default=512, help="prompt token ids are drawn from [2, vocab)")
    g.add_argument("--output-len", type=int, default=32, help="datasets: tokens to generate")
    g.add_argument("--num-prefixes", type=int, default=8, help="shared-prefix: system prompts")
    g.add_argument("--prefix-len", type=int, default=256)
    g.add_argument("--suffix-len", type=int, default=64)
    g.add_argument("--input-len", type=int, default=256, help="random: prompt length")
    g.add_argument("--range-ratio", type=float, default=0.0, help="random: lengths within ±ratio")
    g.add_argument("--priority-levels", type=int, default=1, metavar="N",
                   help="give each request a priority drawn from 0..N-1 (--seed), for --scheduling-policy priority (default 1: all 0)")


def check_workload_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Settles ``a.dataset`` (mooncake with --trace, else shared-prefix) and refuses what no workload can be."""
    if a.dataset is None:
        a.dataset = "mooncake" if a.trace else "shared-prefix"
    if a.dataset == "mooncake" and not a.trace:
        p.error("--dataset mooncake needs --trace FILE")
    if a.trace and a.dataset != "mooncake":
        p.error(f"--trace replays a Mooncake trace; it cannot be combined with --dataset {a.dataset}")
    if a.trace and not Path(a.trace).is_file():
        p.error(f"--trace {a.trace}: no such file")
    if a.priority_levels < 1:
        p.error(f"--priority-levels must be positive, got {a.priority_levels}")
    if a.num_requests is not None and a.num_requests < 0:
        p.error("--num-requests must be >= 0")
    if a.time_scale < 0 or a.request_rate <= 0 or a.burstiness <= 0:
        p.error("--time-scale must be >= 0, --request-rate and --burstiness > 0")
    if a.vocab_size <= 2:
        p.error("--vocab-size must be > 2")
