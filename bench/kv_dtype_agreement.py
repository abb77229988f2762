"""Greedy agreement with vLLM per KV-cache dtype: the same token-id prompts served by both
engines with ``--kv-cache-dtype auto`` and with fp8 (bfloat16 compute by default), and
how many continuations are identical under each cache. One server at a time, each stopped
(its whole process group) before the next starts; every run's ids are saved under
``--out`` so that ``--engines kvpool`` reruns kvpool alone against vLLM's saved ids.

    python -m bench.kv_dtype_agreement --help
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench.compare.servers import Server, ServerConfig, free_port, server_command, vllm_env
from bench.compare.workloads import agreement_prompts, greedy_token_ids

ROOT = Path(__file__).resolve().parent.parent
NAME = "tiny"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.kv_dtype_agreement", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint folder (default: the tiny generated one)")
    p.add_argument("--engines", default="vllm,kvpool", help="engines to run; the others' ids are read from --out")
    p.add_argument("--kv-cache-dtypes", default="auto,fp8")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="the compute dtype of every run")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--seed", type=int, default=7, help="the prompts' seed (bench.compare.workloads.agreement_prompts)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--out", type=Path, default=ROOT / "out/kv_dtype_agreement")
    return p


def run(engine: str, model: Path, cfg: ServerConfig, prompts: list[list[int]], a) -> list[list[int] | None]:
    port = free_port()
    env = {"OMP_NUM_THREADS": str(a.threads)} | (vllm_env(a.out / "cache", cfg, model, a.threads) if engine == "vllm" else {})
    with Server(engine, server_command(engine, model, port, cfg, ROOT, NAME), env, a.out / f"{engine}-{cfg.kv_cache_dtype}.log", port) as s:
        t0 = time.monotonic()
        s.wait_ready(a.ready_timeout)
        print(f"agreement: {engine} {cfg.kv_cache_dtype} ready in {time.monotonic() - t0:.0f} s", flush=True)
        return greedy_token_ids(s.url, NAME, prompts, a.tokens, a.request_timeout)


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.model:
        model = Path(a.model).resolve()
    else:
        from worker.tiny.generate import default_checkpoint

        model = default_checkpoint()
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    prompts = agreement_prompts(a.prompts, vocab, seed=a.seed)
    engines = a.engines.split(",")
    rows = []
    for kv in a.kv_cache_dtypes.split(","):
        cfg = ServerConfig(dtype=a.dtype, num_blocks=256, kv_cache_metrics=False, kv_cache_dtype=kv)
        ids = {}
        for engine in ("vllm", "kvpool"):
            path = a.out / f"{engine}-{kv}-{a.dtype}-{a.prompts}x{a.tokens}-s{a.seed}.json"
            if engine in engines:
                path.write_text(json.dumps(run(engine, model, cfg, prompts, a)) + "\n")
            ids[engine] = json.loads(path.read_text()) if path.exists() else None
        if ids["vllm"] is None or ids["kvpool"] is None:
            print(f"agreement: {kv}: no saved ids for one engine; run it with --engines", flush=True)
            continue
        same = [i for i, (v, k) in enumerate(zip(ids["vllm"], ids["kvpool"], strict=True)) if v is not None and v == k]
        rows.append((kv, len(same), len(prompts), [i for i in range(len(prompts)) if i not in same]))
    print(f"\ngreedy agreement with vLLM, {a.dtype} compute, {a.prompts} prompts x {a.tokens} tokens\n{'kv cache':9} {'identical':>10}  differing prompts")
    for kv, same, n, diff in rows:
        print(f"{kv:9} {same:>4} / {n:<4}  {diff}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
