"""The simulator's P/D fleet flags (simulator/pd_fleet.py): the pools' sizes and the link.

    python -m simulator --dataset random --num-blocks 4000 --replicas 1 --pd 1:1,2:1 \\
        --transfer-gbps 2 --transfer-latency-ms 1
"""

from __future__ import annotations

import argparse
import math

DEFAULT_TRANSFER_GBPS = 2.0
DEFAULT_TRANSFER_LATENCY_MS = 1.0


def pd_list(text: str) -> list[tuple[int, int]]:
    out = []
    for item in (v.strip() for v in text.split(",") if v.strip()):
        p, sep, d = item.partition(":")
        if not sep or not p.isdigit() or not d.isdigit() or int(p) < 1 or int(d) < 1:
            raise argparse.ArgumentTypeError(f"expected P:D (prefill and decode engines, each >= 1), got {item!r}")
        out.append((int(p), int(d)))
    if not out:
        raise argparse.ArgumentTypeError("expected at least one P:D")
    return out


def add_pd_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("P/D fleet (prefill and decode pools, vllm-router's PD mode over vLLM's NixlConnector)")
    g.add_argument("--pd", type=pd_list, default=None, metavar="P:D",
                   help="simulate P prefill and D decode engines behind --router (its policy over each pool); a comma "
                        "list runs each, and with --replicas N the plain fleets too, in one table (--replicas 1: one "
                        "engine, to compare)")
    g.add_argument("--transfer-gbps", type=float, default=None, metavar="GBPS",
                   help="KV bytes a decode engine reads from a prefill engine per second, GB/s; a decode engine's reads "
                        f"go one after another (default {DEFAULT_TRANSFER_GBPS:g}: a TCP link's order; RDMA or NVLink is "
                        "ten to a hundred times faster)")
    g.add_argument("--transfer-latency-ms", type=float, default=None, metavar="MS",
                   help=f"added to every read (default {DEFAULT_TRANSFER_LATENCY_MS:g})")


def check_pd_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Refuse what a P/D fleet cannot take; set the link's defaults."""
    if a.pd is None:
        for flag, value in (("--transfer-gbps", a.transfer_gbps), ("--transfer-latency-ms", a.transfer_latency_ms)):
            if value is not None:
                p.error(f"{flag} applies to P/D fleets: give --pd P:D")
        return
    a.transfer_gbps = DEFAULT_TRANSFER_GBPS if a.transfer_gbps is None else a.transfer_gbps
    a.transfer_latency_ms = DEFAULT_TRANSFER_LATENCY_MS if a.transfer_latency_ms is None else a.transfer_latency_ms
    if not 0 < a.transfer_gbps < math.inf:
        p.error(f"--transfer-gbps must be a positive number, got {a.transfer_gbps}")
    if not 0 <= a.transfer_latency_ms < math.inf:
        p.error(f"--transfer-latency-ms must be >= 0, got {a.transfer_latency_ms}")
    refused = [f for f, v in (("--external-tier", a.external_tier != "none"), ("--num-speculative-tokens", a.num_speculative_tokens),
                              ("--request-path-ms", a.request_path_ms), ("--non-streaming", a.non_streaming),
                              ("--router kv_aware", "kv_aware" in a.router)) if v]
    if refused:
        p.error(f"a P/D fleet runs without {', '.join(refused)}")
