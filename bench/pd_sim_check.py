"""The simulator's P/D fleet held to the live one (issue #49): each live run of
``python -m bench.pd_bench latency`` wrote its requests as a Mooncake trace (when each was
sent, its prompt and output tokens); the simulator replays it for one engine and for
1P1D, and the figures go side by side.

The simulator's step costs a fixed time plus a time per scheduled token. Both are taken
from the live run of the same layout, from two medians only: a long prompt's TTFT gives
the cost of a prefill token, the decode streams' inter-token latency the fixed cost of a
step; every other figure (the p99s, TPOT, the short requests' TTFT, tok/s) is the
simulator's own. The transfer: the measured loopback bandwidth (bench/pd_transfer_bench.py)
and the model's KV bytes per token.

    python -m bench.pd_sim_check --live out/pd/latency-smollm2.json --traces out/pd/latency-smollm2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

KEYS = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "itl_p50_ms", "itl_p99_ms")


def calibrate(live: dict, decoders: int) -> tuple[float, float]:
    """(fixed ms of a step, ms per scheduled token) from one live run's medians."""
    per_token = max(0.001, (live["long_ttft_p50_ms"] - live["decode_itl_p50_ms"]) / max(1, live["long_prompt_tokens"]))
    return max(0.5, live["decode_itl_p50_ms"] - decoders * per_token), per_token


def simulate(trace: Path, layout: str, overhead_ms: float, ms_per_token: float, a) -> dict:
    flags = ["--replicas", "1"]
    if layout != "one":
        flags += ["--pd", "1:1", "--transfer-gbps", str(a.transfer_gbps), "--transfer-latency-ms", str(a.transfer_latency_ms)]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "sim.json"
        argv = [sys.executable, "-m", "simulator", "--trace", str(trace), *flags, "--router", "round_robin", "--block-size", "16",
                "--num-blocks", str(a.num_blocks), "--step-overhead-ms", f"{overhead_ms:.3f}", "--ms-per-token", f"{ms_per_token:.4f}",
                "--kv-bytes-per-token", str(a.kv_bytes_per_token), "--max-num-batched-tokens", "2048", "--result-json", str(out)]
        subprocess.run(argv, check=True, capture_output=True, timeout=600)
        results = json.loads(out.read_text())["results"]
    row = results[-1]  # with --pd, the P/D row comes after the one-engine row
    # ttft_p50_ms here is the simulator's p50_ttft_ms, and so on.
    figures = {k: round(row[f"{k.split('_')[1]}_{k.split('_')[0]}_ms"], 2) for k in KEYS}
    return figures | {"output_tok_s": round(row["output_tokens_per_s"], 1)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--live", default="out/pd/latency-smollm2.json")
    p.add_argument("--traces", default="out/pd/latency-smollm2")
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--kv-bytes-per-token", type=int, default=23_040, help="SmolLM2-135M in bf16: 30 layers x K,V x 3 heads x 64 x 2 bytes")
    p.add_argument("--transfer-gbps", type=float, default=0.9, help="ZMQ between two workers on loopback (bench/pd_transfer_bench.py)")
    p.add_argument("--transfer-latency-ms", type=float, default=1.0)
    a = p.parse_args(argv)
    live_all = json.loads(Path(a.live).read_text())
    decoders = live_all["settings"]["decoders"]
    print("| run | layout | source | step ms + ms/token | TTFT p50 / p99 | TPOT p50 / p99 | ITL p50 / p99 | out tok/s |")
    print("|---|---|---|---|---|---|---|---|")
    for layout in ("one", "1p1d"):
        for i, live in enumerate(live_all[layout]):
            overhead, per_token = calibrate(live, decoders)
            sim = simulate(Path(a.traces) / f"{layout}{i}.jsonl", layout, overhead, per_token, a)
            got = {k: live[f"all_{k}"] for k in KEYS} | {"output_tok_s": round(live["output_tok_s"], 1)}
            for source, f in (("live", got), ("simulator", sim)):
                print(f"| {i} | {layout} | {source} | {overhead:.1f} + {per_token:.3f} | {f['ttft_p50_ms']:.0f} / {f['ttft_p99_ms']:.0f} | "
                      f"{f['tpot_p50_ms']:.1f} / {f['tpot_p99_ms']:.1f} | {f['itl_p50_ms']:.1f} / {f['itl_p99_ms']:.1f} | {f['output_tok_s']} |")


if __name__ == "__main__":
    main()
