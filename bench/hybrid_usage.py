"""Peak KV usage and waiting requests of the hybrid (sliding-window) pool, kvpool beside
vLLM (issue #45): each engine serves the generated Gemma-3-style checkpoint with the same
pool (``--num-gpu-blocks-override``, ``--block-size``), ``vllm bench serve`` drives a
shared-prefix workload (``prefix_repetition``) a few times, and ``/metrics`` is sampled
every ``--period`` s for the peak ``vllm:kv_cache_usage_perc`` and the most
``vllm:num_requests_waiting``; with ``--log-iterations`` also the peak of the usage each
step's log line gives (no sampling: a state a step shows for a few milliseconds is missed
by the sampler by chance, on either engine). One server at a time, each stopped (its whole process group) before the next.

    python -m bench.hybrid_usage --help
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from bench.compare.checkpoints import checkpoint_dir
from bench.compare.servers import (
    COUNTERS,
    PEAK,
    Server,
    ServerConfig,
    free_port,
    scrape,
    server_command,
    vllm_env,
)
from bench.compare.workloads import Workload, prefix_args, repeated, run_bench

ROOT = Path(__file__).resolve().parent.parent
NAME = "tiny"
# The KV usage each step's --enable-logging-iteration-details line ends with (both engines
# print it from the step's own stats, after its result: vLLM's reading, every step).
ITERATION_USAGE = re.compile(r"Iteration\(\d+\):.*KV cache usage: ([0-9.]+)%")
GAUGES = ("vllm:kv_cache_usage_perc", "vllm:num_requests_waiting", "vllm:num_requests_running")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.hybrid_usage", description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", default="vllm,kvpool")
    p.add_argument("--checkpoint", default="gemma3", help="a generated checkpoint (bench.compare.checkpoints)")
    p.add_argument("--layer-types", default=None,
                   help="comma-separated sliding/full per layer: a copy of the checkpoint with these layer_types "
                        "(e.g. s,s,f,s,s,f: a window on 4 of 6 layers, 3 KV-cache groups)")
    p.add_argument("--num-blocks", type=int, default=256)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--dtype", default="float32")
    # NOTE: vLLM refuses a pool that cannot hold one max_model_len request in every group
    # (256 blocks over Gemma 3's 6 groups hold 1,312 tokens).
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=96)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--period", type=float, default=0.05, help="seconds between /metrics samples")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--bench-timeout", type=float, default=900.0)
    p.add_argument("--log-iterations", action="store_true", help="both servers log each step (--enable-logging-iteration-details)")
    p.add_argument("--out", type=Path, default=ROOT / "out/hybrid_usage")
    return p


def with_layer_types(model: Path, kinds: list[str], out: Path) -> Path:
    """A folder of links to ``model``'s files whose config.json has these layer types
    (``s``: sliding_attention, ``f``: full_attention); the weights are the same."""
    config = json.loads((model / "config.json").read_text())
    if len(kinds) != config["num_hidden_layers"] or set(kinds) - {"s", "f"}:
        raise SystemExit(f"--layer-types: one s or f per layer ({config['num_hidden_layers']}), got {kinds}")
    folder = out / "-".join(kinds)
    folder.mkdir(parents=True, exist_ok=True)
    for f in model.iterdir():
        if f.name != "config.json" and not (folder / f.name).exists():
            (folder / f.name).symlink_to(f.resolve())
    config["layer_types"] = ["sliding_attention" if k == "s" else "full_attention" for k in kinds]
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def gauges(url: str) -> dict[str, float]:
    """GAUGES, each summed over its label sets."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    out = dict.fromkeys(GAUGES, 0.0)
    for fam in text_string_to_metric_families(text):
        if fam.name in out:
            out[fam.name] += sum(s.value for s in fam.samples if s.name == fam.name)
    return out


class GaugeSampler(threading.Thread):
    """Every period_s until stopped: the peak usage, the most waiting and, while any
    request is in the server, the least running."""

    def __init__(self, url: str, period_s: float):
        super().__init__(daemon=True)
        self.url, self.period_s = url, period_s
        self.peak_usage, self.max_waiting, self.min_running, self.num_samples = 0.0, 0, None, 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.period_s):
            try:
                g = gauges(self.url)
            except (urllib.error.URLError, OSError, ValueError):
                continue
            self.num_samples += 1
            self.peak_usage = max(self.peak_usage, g["vllm:kv_cache_usage_perc"])
            waiting, running = int(g["vllm:num_requests_waiting"]), int(g["vllm:num_requests_running"])
            self.max_waiting = max(self.max_waiting, waiting)
            if waiting:
                self.min_running = running if self.min_running is None else min(self.min_running, running)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(10)


def run_engine(engine: str, model: Path, cfg: ServerConfig, w: Workload, a) -> list[dict]:
    port = free_port()
    env = {"OMP_NUM_THREADS": str(a.threads)} | (vllm_env(a.out / "cache", cfg, model, a.threads) if engine == "vllm" else {})
    rows = []
    cmd = server_command(engine, model, port, cfg, ROOT, NAME) + (["--enable-logging-iteration-details"] if a.log_iterations else [])
    with Server(engine, cmd, env, a.out / f"{engine}.log", port) as s:
        t0 = time.monotonic()
        s.wait_ready(a.ready_timeout)
        print(f"hybrid_usage: {engine} ready in {time.monotonic() - t0:.0f} s", flush=True)
        for rep in range(a.runs):
            log_start = a.out.joinpath(f"{engine}.log").stat().st_size
            before = scrape(s.url)
            sampler = GaugeSampler(s.url, a.period)
            sampler.start()
            try:
                fig = run_bench(ROOT, s.url, model, NAME, repeated(w, rep), a.out / engine, a.bench_timeout)
            finally:
                sampler.stop()
            after = scrape(s.url)
            with open(a.out / f"{engine}.log", "rb") as f:
                f.seek(log_start)
                step_peak = max((float(m) / 100 for m in ITERATION_USAGE.findall(f.read().decode(errors="replace"))), default=None)
            row = {"engine": engine, "run": rep, "peak_usage": sampler.peak_usage, "step_peak_usage": step_peak, "max_waiting": sampler.max_waiting,
                   "min_running_while_waiting": sampler.min_running, "samples": sampler.num_samples,
                   "completed": fig["completed"], "exact_peak_since_start": after.get(PEAK),
                   **{c: after[c] - before[c] for c in COUNTERS}}
            rows.append(row)
            print(f"hybrid_usage: {json.dumps(row)}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    model = checkpoint_dir(a.checkpoint)
    if a.layer_types:
        model = with_layer_types(model, a.layer_types.split(","), a.out / "checkpoint")
    cfg = ServerConfig(block_size=a.block_size, num_blocks=a.num_blocks, max_model_len=a.max_model_len, dtype=a.dtype)
    w = Workload("prefix", "main", prefix_args(a.num_prompts, a.concurrency, a.output_len, seed=5, prefix_len=a.prefix_len,
                                               suffix_len=a.suffix_len), shared_prefix=True)
    rows = [r for engine in a.engines.split(",") for r in run_engine(engine, model, cfg, w, a)]
    print(f"\n{'engine':8} {'run':>3} {'peak usage':>10} {'step peak':>9} {'max waiting':>11} {'queries':>8} {'hits':>8}")
    for r in rows:
        step = "-" if r["step_peak_usage"] is None else f"{r['step_peak_usage']:.3f}"
        print(f"{r['engine']:8} {r['run']:>3} {r['peak_usage']:>10.3f} {step:>9} {r['max_waiting']:>11} "
              f"{r['vllm:prefix_cache_queries']:>8.0f} {r['vllm:prefix_cache_hits']:>8.0f}")
    (a.out / "result.json").write_text(json.dumps({"settings": vars(a) | {"out": str(a.out)}, "rows": rows}, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
