"""What an fp8 KV cache costs in fidelity, kvpool's beside vLLM's own: per engine, the
same greedy prompts served with ``--kv-cache-dtype auto`` and with fp8 (the same compute
dtype, bfloat16 by default), and the per-token drift of the chosen tokens' logprobs
between the two, over the positions where both runs still have the same context (up to
each pair's first differing token). One server at a time, each stopped (its whole process
group) before the next starts.

    python -m bench.kv_dtype_drift --help
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.compare.servers import Server, ServerConfig, free_port, server_command, vllm_env
from bench.compare.workloads import agreement_prompts

ROOT = Path(__file__).resolve().parent.parent
NAME = "tiny"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.kv_dtype_drift", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint folder (default: the tiny generated one)")
    p.add_argument("--engines", default="vllm,kvpool")
    p.add_argument("--kv-cache-dtype", default="fp8", choices=["fp8", "fp8_e4m3", "fp8_e5m2"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="the compute dtype of every run")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--out", type=Path, default=ROOT / "out/kv_dtype_drift")
    return p


def greedy_logprobs(url: str, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], list[float]]]:
    """Each prompt's greedy tokens and their logprobs."""

    def one(prompt: list[int]) -> tuple[list[int], list[float]]:
        body = {"model": NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                "logprobs": 1, "return_tokens_as_token_ids": True}
        req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            lp = json.loads(r.read())["choices"][0]["logprobs"]
        return [int(t.removeprefix("token_id:")) for t in lp["tokens"]], [float(x) for x in lp["token_logprobs"]]

    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, prompts))


def drift(base: list[tuple[list[int], list[float]]], other: list[tuple[list[int], list[float]]]) -> dict:
    """|logprob difference| of the same token at the same position, while the contexts are
    the same (the first differing token is compared too: its context still is)."""
    diffs: list[float] = []
    identical = 0
    for (t0, l0), (t1, l1) in zip(base, other, strict=True):
        identical += t0 == t1
        for i in range(len(t0)):
            if t0[i] != t1[i]:
                break
            diffs.append(abs(l0[i] - l1[i]))
    return {"tokens_compared": len(diffs), "mean_abs_logprob_drift": statistics.fmean(diffs) if diffs else None,
            "max_abs_logprob_drift": max(diffs) if diffs else None, "identical_sequences": identical / len(base)}


def run(engine: str, model: Path, cfg: ServerConfig, prompts, a) -> list:
    port = free_port()
    env = {"OMP_NUM_THREADS": str(a.threads)} | (vllm_env(a.out / "cache", cfg, model, a.threads) if engine == "vllm" else {})
    with Server(engine, server_command(engine, model, port, cfg, ROOT, NAME), env, a.out / f"{engine}-{cfg.kv_cache_dtype}.log", port) as s:
        t0 = time.monotonic()
        s.wait_ready(a.ready_timeout)
        print(f"drift: {engine} {cfg.kv_cache_dtype} ready in {time.monotonic() - t0:.0f} s", flush=True)
        return greedy_logprobs(s.url, prompts, a.tokens)


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.model:
        model = Path(a.model).resolve()
    else:
        sys.path.insert(0, str(ROOT))
        from worker.tiny.generate import default_checkpoint

        model = default_checkpoint()
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    prompts = agreement_prompts(a.prompts, vocab, seed=17)
    base = ServerConfig(dtype=a.dtype, num_blocks=256, kv_cache_metrics=False)
    results = {}
    for engine in a.engines.split(","):
        auto = run(engine, model, base, prompts, a)
        fp8 = run(engine, model, ServerConfig(dtype=a.dtype, num_blocks=256, kv_cache_metrics=False, kv_cache_dtype=a.kv_cache_dtype),
                  prompts, a)
        results[engine] = drift(auto, fp8)
    head = f"{'engine':8} {'tokens':>7} {'mean |dlogprob|':>16} {'max |dlogprob|':>15} {'identical':>10}"
    print(f"\n{a.kv_cache_dtype} KV cache vs the {a.dtype} cache, {a.dtype} compute, {a.prompts} prompts x {a.tokens} greedy tokens\n{head}")
    for engine, r in results.items():
        mean, top = r["mean_abs_logprob_drift"], r["max_abs_logprob_drift"]
        print(f"{engine:8} {r['tokens_compared']:7d} {mean:16.4f} {top:15.4f} {r['identical_sequences']:10.3f}")
    (a.out / "drift.json").write_text(json.dumps({"settings": vars(a) | {"out": str(a.out)}, "results": results}, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
