"""``make compare``'s runs: each engine's server for each pool, every workload of that pool
against it, each server stopped (its whole process group) before the next starts; then
greedy agreement in float32, and the small pool's shape queued at once offline
(bench/compare/offline.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from bench.compare.cli import NAME, ROOT
from bench.compare.lm_eval_tasks import LM_EVAL, compare_samples
from bench.compare.metrics import METRICS
from bench.compare.offline import (
    QUEUED,
    queued_prompts,
    run_kvpool,
    run_vllm,
    shared_generated_blocks,
)
from bench.compare.report import SPEED_WORKLOADS
from bench.compare.servers import (
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
from bench.compare.workloads import (
    SMALL_OUTPUT_LEN,
    agreement,
    agreement_prompts,
    combine_runs,
    greedy_token_ids,
    repeated,
    run_bench,
)


def serve(engine: str, model: Path, cfg: ServerConfig, a, tag: str) -> Server:
    port = free_port()
    # NOTE: the same compute threads on the same cores on both sides. The default is both
    # engines' own rule, a core left to their other processes (vLLM's CPU backend binds the
    # cores less one, kvpool's worker takes one thread fewer than the cores). More threads
    # are no fair default: on 2 cores vLLM ran slower with two than with one.
    # None (compare.speed's default): no thread settings at all, each engine's own default.
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
    """The small pool's shape queued at once on each engine (bench/compare/offline.py)."""
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
