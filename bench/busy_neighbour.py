"""A busy neighbour (issue #45): SmolLM2 served by vLLM, then by kvpool, while another
process keeps one core busy; and kvpool again with the cores free, to show what its wide
steps (worker/cpu/threads.py) are worth when nothing stands in their way.

The neighbour is NVIDIA's aiperf 0.13 itself (its timing process keeps a core busy):
chat, streaming, 200-token synthetic prompts, 48 tokens out, 12 requests at concurrency 4,
from its own venv (``.venv-aiperf``: ``python -m venv .venv-aiperf && .venv-aiperf/bin/pip
install aiperf==0.13.0``). ``--neighbour spin`` puts a busy loop at nice 0 on the last
core instead and drives the load with kvpool's load generator (the same requests, chat,
streaming), for a machine without aiperf. The free-core rows use the load generator
without the loop. kvpool runs at its defaults and with ``--cpu-wide-step-tokens 0``
(never wide), so each table row pair shows what going wide gains or costs; the wide-step
column is the worker's share of steps that ran on every core (its
``kvpool_worker_wide_steps`` over ``kvpool_worker_steps``).

Each server is up alone and warmed by 4 untimed requests; each figure is the median of
--repeat runs.

    python -m bench.busy_neighbour --out out/busy-neighbour
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

from bench.compare.servers import (
    Server,
    ServerConfig,
    free_port,
    scrape_page,
    server_command,
    stop_process_group,
    vllm_env,
)
from bench.compare.workloads import Workload, run_loadgen
from bench.real_model import smollm2_checkpoint

ROOT = Path(__file__).resolve().parents[1]
NAME = "smollm2"
AIPERF = ROOT / ".venv-aiperf" / "bin" / "aiperf"
# engine -> (server, kvpool serve's extra flags)
ENGINES = {"vllm": ("vllm", []), "kvpool": ("kvpool", []), "kvpool-narrow": ("kvpool", ["--cpu-wide-step-tokens", "0"])}


def aiperf_command(url: str, model: Path, out: Path, a: argparse.Namespace, num_requests: int, seed: int) -> list[str]:
    return [str(AIPERF), "profile", "--model", NAME, "--url", url, "--endpoint-type", "chat", "--streaming",
            "--tokenizer", str(model), "--isl", str(a.input_len), "--isl-stddev", "0", "--osl", str(a.output_len),
            "--osl-stddev", "0", "--extra-inputs", "ignore_eos:true", "--extra-inputs", f"min_tokens:{a.output_len}",
            "--request-count", str(num_requests), "--concurrency", str(a.concurrency), "--random-seed", str(seed),
            "--ui-type", "none", "--artifact-dir", str(out)]


def run_aiperf(url: str, model: Path, out: Path, a: argparse.Namespace, num_requests: int, seed: int) -> dict:
    """One aiperf run; its output token throughput and request count."""
    out.mkdir(parents=True, exist_ok=True)
    # NOTE: not HF_HUB_OFFLINE: aiperf then looks the tokenizer up in the hub's cache by
    # name, and a folder is no hub name; an absolute path is read as a local folder.
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    with open(out / "aiperf.log", "wb") as log:
        p = subprocess.run(aiperf_command(url, model, out, a, num_requests, seed), stdout=log, stderr=subprocess.STDOUT, env=env,
                           timeout=a.timeout, cwd=out)
    found = sorted(out.rglob("profile_export_aiperf.json"))
    if p.returncode != 0 or not found:
        raise RuntimeError(f"aiperf failed with {p.returncode}; see {out / 'aiperf.log'}")
    data = json.loads(found[-1].read_text())
    return {"output_throughput": data["output_token_throughput"]["avg"], "completed": data["request_count"]["avg"]}


def loadgen_workload(a: argparse.Namespace, name: str, num_requests: int, seed: int) -> Workload:
    return Workload(name, "main", ("--dataset", "random", "--input-len", str(a.input_len), "--range-ratio", "0",
                                   "--output-len", str(a.output_len), "--vocab-size", "49152", "--num-requests", str(num_requests),
                                   "--max-concurrency", str(a.concurrency), "--seed", str(seed)), client="loadgen")


@contextmanager
def busy_loop():
    """A process spinning at nice 0 on the last core this one may use, stopped on leaving."""
    cpu = max(os.sched_getaffinity(0))
    proc = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"],
                            start_new_session=True)
    try:
        yield
    finally:
        stop_process_group(proc, 5)


def wide_share(worker_url: str | None) -> tuple[float, float]:
    """The worker's (wide steps, steps) so far; (0, 0) without its /metrics (vLLM)."""
    if worker_url is None:
        return 0.0, 0.0
    page = scrape_page(worker_url)
    total = {"kvpool_worker_wide_steps_total": 0.0, "kvpool_worker_steps_total": 0.0}
    for line in page.splitlines():
        name = line.split("{", 1)[0]
        if name in total:
            total[name] += float(line.rsplit(" ", 1)[1])
    return total["kvpool_worker_wide_steps_total"], total["kvpool_worker_steps_total"]


def run_case(s: Server, worker_url: str | None, model: Path, a: argparse.Namespace, out: Path, beside: bool, rep: int) -> dict:
    """One timed run: beside the neighbour (aiperf, or the busy loop and the load generator),
    or with the cores free (the load generator alone)."""
    before = wide_share(worker_url)
    if beside and a.neighbour == "aiperf":
        fig = run_aiperf(s.url, model, out / f"aiperf-r{rep}", a, a.num_requests, 1 + rep)
    elif beside:
        with busy_loop():
            fig = run_loadgen(ROOT, s.url, model, NAME, loadgen_workload(a, f"spin-r{rep}", a.num_requests, 1 + rep), out, a.timeout)
    else:
        fig = run_loadgen(ROOT, s.url, model, NAME, loadgen_workload(a, f"free-r{rep}", a.num_requests, 1 + rep), out, a.timeout)
    after = wide_share(worker_url)
    wide, steps = after[0] - before[0], after[1] - before[1]
    return {"output_throughput": fig["output_throughput"], "wide_share": wide / steps if steps else None}


def run_engine(engine: str, model: Path, a: argparse.Namespace, results: dict) -> None:
    base, extra = ENGINES[engine]
    cfg = ServerConfig(dtype="bfloat16")
    port = free_port()
    cmd = server_command(base, model, port, cfg, ROOT, NAME) + extra
    worker_url = None
    if base == "kvpool":
        worker_port = free_port()
        cmd += ["--worker-http-port", str(worker_port)]
        worker_url = f"http://127.0.0.1:{worker_port}"
    env = vllm_env(a.out / "cache", cfg, model, None) if base == "vllm" else {}
    out = a.out / engine
    with Server(base, cmd, env, out / "server.log", port) as s:
        s.wait_ready(900)
        run_loadgen(ROOT, s.url, model, NAME, loadgen_workload(a, "warmup", 4, 99), out, a.timeout)
        for case in a.cases.split(","):
            if case == "free" and engine == "vllm" and not a.vllm_free:
                continue
            runs = [run_case(s, worker_url, model, a, out, case == "beside", rep) for rep in range(a.repeat)]
            results.setdefault(engine, {})[case] = runs
            for rep, r in enumerate(runs):
                share = "-" if r["wide_share"] is None else f"{r['wide_share']:.0%}"
                print(f"busy_neighbour: {engine} {case} rep {rep}: {r['output_throughput']:.1f} tok/s, wide steps {share}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.busy_neighbour", description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", default="vllm,kvpool,kvpool-narrow", help="of " + ", ".join(ENGINES) + " (default %(default)s)")
    p.add_argument("--cases", default="beside,free", help="beside (the neighbour), free (no neighbour) (default %(default)s)")
    p.add_argument("--neighbour", choices=("aiperf", "spin"), default="aiperf",
                   help="aiperf as client and neighbour, or a nice-0 busy loop beside kvpool's load generator (default %(default)s)")
    p.add_argument("--vllm-free", action="store_true", help="also time vLLM with the cores free")
    p.add_argument("--num-requests", type=int, default=12)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--input-len", type=int, default=200)
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one client run may take")
    p.add_argument("--out", type=Path, default=ROOT / "out" / "busy-neighbour")
    a = p.parse_args(argv)
    if a.neighbour == "aiperf" and "beside" in a.cases and not AIPERF.exists():
        p.error(f"{AIPERF} is missing: python -m venv .venv-aiperf && .venv-aiperf/bin/pip install aiperf==0.13.0 (or --neighbour spin)")
    a.out = a.out.resolve()
    a.out.mkdir(parents=True, exist_ok=True)
    model = smollm2_checkpoint()
    results: dict = {}
    for engine in a.engines.split(","):
        run_engine(engine, model, a, results)
    (a.out / "result.json").write_text(json.dumps(results, indent=1))
    client = "aiperf 0.13" if a.neighbour == "aiperf" else "a nice-0 busy loop on one core, kvpool's load generator"
    print(f"\nSmolLM2-135M bf16, chat, streaming, {a.input_len} tokens in, {a.output_len} out, {a.num_requests} requests at "
          f"concurrency {a.concurrency}; beside: {client}; free: kvpool's load generator alone; median of {a.repeat}\n")
    print("| engine | cores | output tok/s | wide steps |")
    print("|---|---|---|---|")
    for engine, cases in results.items():
        for case, runs in cases.items():
            tok = statistics.median(r["output_throughput"] for r in runs)
            shares = [r["wide_share"] for r in runs if r["wide_share"] is not None]
            share = f"{statistics.median(shares):.0%}" if shares else "-"
            print(f"| {engine} | {'beside the neighbour' if case == 'beside' else 'free'} | {tok:.1f} | {share} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
