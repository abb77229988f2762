"""KV blocks between two worker processes on one host (issue #49, prefill/decode
disaggregation): ZMQ and Mooncake's Transfer Engine on loopback, against a plain memory
copy of the same bytes (``python -m bench.pd_transfer_bench [--blocks 1 8 64 256]``).

The payload is KV blocks shaped as SmolLM2-135M's in bf16: 30 layers, 3 KV heads of 64,
block size 16, so a block is 30 x 2 x 16 x 3 x 64 x 2 bytes. Each worker holds one KV
tensor per layer, (2, num_blocks, block_size, kv_heads, head_dim), as the real worker does;
a transfer reads N blocks at scattered ids of the prefill worker's tensors into other
scattered ids of the decode worker's.

* memcpy: one process copies N blocks' bytes into a preallocated buffer (torch ``copy_``,
  numpy ``copyto``); and gathers then scatters the same blocks between two KV tensors in
  one process (the work a transfer adds to the copy, without the wire).
* zmq: the decode worker (this process, a DEALER) asks the prefill worker (a child
  process, a ROUTER on tcp://127.0.0.1) for N blocks; the server gathers them per layer
  (``index_select``) and sends one frame per layer with ``copy=False``; the reader writes
  them into its own tensors (``index_copy_``). "read" times request to blocks written;
  "wire" asks for blocks the server gathered before and writes nothing.
* mooncake: a Transfer Engine ("tcp", P2PHANDSHAKE, 127.0.0.1) in each of two child
  processes, each registering its KV tensors and one contiguous buffer. "kv" reads the N
  blocks' K and V of every layer (2 x 30 x N segments, one ``batch_transfer_sync_read``)
  straight into the reader's KV tensors at other ids; "wire" reads N blocks' bytes from the
  peer's contiguous buffer into the local one (``transfer_sync_read``). The segment lists
  are built before the clock starts.

Each figure is the median of ``--repeats`` runs after ``--warmup``; GB/s is 1e9 bytes
per second of payload. Every transfer is checked byte for byte once per size. Prints a
markdown table and writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import zmq

from bench.pd_transfer_parts import DEFAULT_BLOCKS, KVLayout, bench_memcpy
from bench.pd_transfer_te import bench_mooncake
from bench.pd_transfer_zmq import ZmqBlockReader, bench_zmq


@dataclass(frozen=True, slots=True)
class BenchConfig:
    blocks: tuple[int, ...]
    repeats: int
    warmup: int
    transports: tuple[str, ...]
    mooncake_timeout_s: float
    out: Path


def run(cfg: BenchConfig) -> dict:
    layout = KVLayout(num_blocks=2 * max(cfg.blocks))
    seed = 0
    results: dict[int, dict] = {n: {} for n in cfg.blocks}
    load_before = os.getloadavg()
    if "memcpy" in cfg.transports:
        for n in cfg.blocks:
            results[n]["memcpy"] = bench_memcpy(layout, n, cfg.repeats, cfg.warmup)
    if "zmq" in cfg.transports:
        with ZmqBlockReader(layout, seed) as reader:
            for n in cfg.blocks:
                results[n]["zmq"] = bench_zmq(reader, layout, seed, n, cfg.repeats, cfg.warmup)
    mooncake_error = None
    if "mooncake" in cfg.transports:
        te = bench_mooncake(
            layout, seed, list(cfg.blocks), cfg.repeats, cfg.warmup, cfg.mooncake_timeout_s
        )
        mooncake_error = te.get("error")
        for n in cfg.blocks if mooncake_error is None else ():
            results[n]["mooncake"] = te[n]
    return {
        "config": {**asdict(cfg), "out": str(cfg.out)},
        "layout": {
            **asdict(layout),
            "dtype": "bfloat16",
            "bytes_per_block": layout.bytes_per_block,
        },
        "machine": {
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
            "versions": {
                "torch": torch.__version__,
                "pyzmq": zmq.__version__,
                "libzmq": zmq.zmq_version(),
                "numpy": np.__version__,
            },
        },
        "mooncake_error": mooncake_error,
        "results": {str(n): r for n, r in results.items()},
    }


COLUMNS = [
    ("torch copy_", ("memcpy", "torch_copy")),
    ("numpy copyto", ("memcpy", "numpy_copyto")),
    ("gather+scatter, 1 proc", ("memcpy", "gather_scatter")),
    ("ZMQ read", ("zmq", "read")),
    ("ZMQ wire", ("zmq", "wire")),
    ("TE kv read", ("mooncake", "kv")),
    ("TE wire", ("mooncake", "wire")),
]


def markdown_table(report: dict) -> str:
    """GB/s per size and transport; the last column, ZMQ's whole read over torch's copy."""
    bpb = report["layout"]["bytes_per_block"]
    lines = [
        "| blocks | MiB | " + " | ".join(name for name, _ in COLUMNS) + " | ZMQ read / copy_ |",
        "|---:" * (len(COLUMNS) + 3) + "|",
    ]
    for n, r in report["results"].items():
        cells = [f"{r[t][k]['gbps']:.2f}" if t in r else "-" for _, (t, k) in COLUMNS]
        ratio = (
            f"{r['zmq']['read']['gbps'] / r['memcpy']['torch_copy']['gbps']:.0%}"
            if "zmq" in r and "memcpy" in r
            else "-"
        )
        lines.append(f"| {n} | {int(n) * bpb / 2**20:.1f} | " + " | ".join(cells) + f" | {ratio} |")
    if report["mooncake_error"]:
        lines.append(f"\nMooncake Transfer Engine did not run: {report['mooncake_error']}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.pd_transfer_bench", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--blocks",
        type=int,
        nargs="+",
        default=list(DEFAULT_BLOCKS),
        help="blocks per transfer (default: %(default)s)",
    )
    p.add_argument(
        "--repeats", type=int, default=10, help="timed runs per figure; the median is reported"
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed runs before them")
    p.add_argument(
        "--transports",
        nargs="+",
        choices=["memcpy", "zmq", "mooncake"],
        default=["memcpy", "zmq", "mooncake"],
    )
    p.add_argument(
        "--mooncake-timeout-s",
        type=float,
        default=300.0,
        help="bound on the Transfer Engine reader's whole run",
    )
    p.add_argument("--out", type=Path, default=Path("out/pd-transfer/results.json"))
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if min(args.blocks) < 1 or args.repeats < 1 or args.warmup < 0:
        raise SystemExit("--blocks must be >= 1, --repeats >= 1, --warmup >= 0")
    cfg = BenchConfig(
        tuple(args.blocks),
        args.repeats,
        args.warmup,
        tuple(args.transports),
        args.mooncake_timeout_s,
        args.out,
    )
    report = run(cfg)
    print(markdown_table(report))
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    cfg.out.write_text(json.dumps(report, indent=2))
    print(
        f"\nGB/s = 1e9 bytes/s, median of {cfg.repeats} after {cfg.warmup} warm-up; JSON: {cfg.out}"
    )


if __name__ == "__main__":
    main()
