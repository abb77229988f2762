"""The simulator's external-tier flags (simulator/external_worker.py): which tier, its size,
its speeds, and a warm start.

    python -m simulator --trace conversation_trace.jsonl --num-blocks 20000 \\
        --external-tier disk --external-tier-blocks 0,200000 --external-tier-warm
"""

from __future__ import annotations

import argparse
import math

from simulator.external_io import EXTERNAL_TIER_SPEEDS, EXTERNAL_TIERS
from simulator.run_setup import int_list

_DISK, _STORE = EXTERNAL_TIER_SPEEDS["disk"], EXTERNAL_TIER_SPEEDS["store"]


def add_external_tier_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("external tier (disk, Mooncake Store)")
    g.add_argument("--external-tier", choices=EXTERNAL_TIERS, default="none",
                   help="a tier below the device (and the host tier) that keeps every computed block (write-through) "
                        "and serves later requests' prefixes, loaded off the step path while the request waits: "
                        "the server's --kv-offloading-backend disk (a local NVMe directory) or mooncake (a Mooncake "
                        "Store; store here). Default speeds: disk reads at "
                        f"{_DISK.read_gbps:g} GB/s and writes at {_DISK.write_gbps:g} GB/s, a PCIe 3.0 x4 NVMe SSD's "
                        "sequential rates (datasheets: ~3.5 read, ~2-3 write) less a file system's toll; store "
                        f"{_STORE.read_gbps:g} GB/s each way, a 10 GbE link's line rate (1.25 GB/s: Mooncake's "
                        "transfer engine over TCP; RDMA is several times faster). Default: none")
    g.add_argument("--external-tier-blocks", type=int_list, default=[0], metavar="N",
                   help="the tier's capacity in blocks (with hybrid groups, one group's blocks), least recently used "
                        "evicted beyond it; 0: unbounded; a comma list runs each (default 0)")
    g.add_argument("--external-read-gbps", type=float, default=None, metavar="GBPS",
                   help=f"read bandwidth of a load, GB/s (default: disk {_DISK.read_gbps:g}, store {_STORE.read_gbps:g})")
    g.add_argument("--external-write-gbps", type=float, default=None, metavar="GBPS",
                   help=f"write bandwidth of a save, GB/s (default: disk {_DISK.write_gbps:g}, store {_STORE.write_gbps:g}); "
                        "saves and loads share the worker's one I/O thread, first in first out, so saves the bandwidth "
                        "cannot keep up with delay the loads behind them (the backlog figures)")
    g.add_argument("--external-latency-ms", type=float, default=None, metavar="MS",
                   help=f"added to every load (default: disk {_DISK.latency_ms:g}, an NVMe read's order; store "
                        f"{_STORE.latency_ms:g}, assumed for a lookup at the master and a TCP round trip)")
    g.add_argument("--external-tier-warm", action="store_true",
                   help="replay the workload once to fill the tier, then measure a second replay with everything else "
                        "fresh: the device and host tier empty, the tier as the first replay left it (a restart)")


def check_external_tier_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Refuse what the external tier cannot take, or flags for a tier that is not there."""
    if a.external_tier == "none":
        given = [f for f, v in (("--external-read-gbps", a.external_read_gbps), ("--external-write-gbps", a.external_write_gbps),
                                ("--external-latency-ms", a.external_latency_ms), ("--external-tier-warm", a.external_tier_warm or None),
                                ("--external-tier-blocks", None if a.external_tier_blocks == [0] else 1)) if v is not None]
        if given:
            p.error(f"{', '.join(given)} need --external-tier disk or store")
        return
    if any(n < 0 for n in a.external_tier_blocks):
        p.error(f"--external-tier-blocks must be >= 0 (0: unbounded), got {min(a.external_tier_blocks)}")
    for flag, value in (("--external-read-gbps", a.external_read_gbps), ("--external-write-gbps", a.external_write_gbps)):
        if value is not None and not 0 < value < math.inf:
            p.error(f"{flag} must be a positive number, got {value}")
    if a.external_latency_ms is not None and not 0 <= a.external_latency_ms < math.inf:
        p.error(f"--external-latency-ms must be >= 0, got {a.external_latency_ms}")
    if a.replicas:
        p.error("--external-tier runs with one engine: no --replicas")
