"""Speculative decoding's speed row (issue #46): n-gram (or suffix decoding) drafts on the
real model, against kvpool without them and vLLM with the same --speculative-config.

The workload answers by copying its prompt: ShareGPT first turns of 60..220 words, each sent
as a proofreading request through the chat template ("Correct the spelling and grammar of
the following text. Reply with the corrected text only."), as ``vllm bench serve
--dataset-name custom`` sends them; each answer's length is its passage's token count (so
the answer could be the passage, corrected), ignore_eos, the client's default sampling (the
server's generation config). Every server is up alone, warmed by one untimed run; each
repeat starts every engine's server again, in the other order on odd repeats (alternating
runs: a slow spell of the shared machine falls on every engine); each figure is the median of
--repeat runs.

    python -m bench.spec_decode --concurrency 1,8 --out out/spec-decode
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from bench.compare.servers import (
    Server,
    ServerConfig,
    free_port,
    scrape_page,
    server_command,
    vllm_env,
)
from bench.compare.workloads import Workload, run_bench
from bench.real_model import sharegpt_json, smollm2_checkpoint

ROOT = Path(__file__).resolve().parents[1]
NAME = "smollm2"
INSTRUCTION = "Correct the spelling and grammar of the following text. Reply with the corrected text only.\n\n"
SPEC = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'
SUFFIX_SPEC = '{"method": "suffix"}'  # vLLM's defaults: trees 24 deep, drafts up to the match's length
# An engine's name: the server, then what it drafts with ("kvpool": none, "kvpool-spec": n-gram).
SPECS = {"spec": SPEC, "suffix": SUFFIX_SPEC}


def copy_dataset(sharegpt: Path, out: Path, n: int, tokenizer) -> Path:
    """The first ``n`` ShareGPT first turns of 60..220 words as vllm bench's custom JSONL."""
    rows = []
    for conv in json.loads(sharegpt.read_text()):
        turns = conv.get("conversations") or []
        if not turns or turns[0].get("from") != "human":
            continue
        text = turns[0]["value"].strip()
        if not 60 <= len(text.split()) <= 220 or "```" in text:
            continue
        rows.append({"prompt": INSTRUCTION + text, "output_tokens": len(tokenizer(text).input_ids)})
        if len(rows) == n:
            break
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def spec_counters(url: str) -> dict[str, float]:
    page = scrape_page(url)
    out = {}
    for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
        out[name] = sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines() if line.startswith(name + "{"))
    return out


def run_engine(engine: str, rep: int, model: Path, cfg: ServerConfig, data: Path, a: argparse.Namespace, runs: dict) -> None:
    """One repeat of one engine: its server started and warmed, then a run at each concurrency
    (its figures, the spec-decode and prefix-cache counters' growth included, into runs[c])."""
    base, _, drafts = engine.partition("-")
    port = free_port()
    cmd = server_command(base, model, port, cfg, ROOT, NAME) + (["--speculative-config", SPECS[drafts]] if drafts else [])
    env = vllm_env(a.out / "cache", cfg, model, None) if base == "vllm" else {}
    with Server(base, cmd, env, a.out / f"{engine}-r{rep}.log", port) as s:
        s.wait_ready(900)
        warm = Workload("warmup", "main", ("--dataset-name", "custom", "--dataset-path", str(data), "--custom-output-len", "-1",
                                           "--num-prompts", "4", "--max-concurrency", "4", "--ignore-eos", "--seed", "99"))
        run_bench(ROOT, s.url, model, NAME, warm, a.out / engine, 1800, None)
        for c in runs:
            w = replace(warm, name=f"c{c}-r{rep}", args=("--dataset-name", "custom", "--dataset-path", str(data),
                        "--custom-output-len", "-1", "--num-prompts", str(a.num_prompts if c > 1 else a.num_prompts // 2),
                        "--max-concurrency", str(c), "--ignore-eos", "--seed", str(1 + rep)))
            before = spec_counters(s.url)
            fig = run_bench(ROOT, s.url, model, NAME, w, a.out / engine, 1800, None)
            after = spec_counters(s.url)
            fig |= {k.split(":")[1]: after[k] - before[k] for k in after}
            runs[c].append(fig)
            print(f"spec_decode: {engine} c{c} rep {rep}: {fig['output_throughput']:.1f} tok/s, TPOT p50 {fig['median_tpot_ms']:.1f} ms, "
                  f"drafts {fig['spec_decode_num_drafts_total']:.0f}, accepted {fig['spec_decode_num_accepted_tokens_total']:.0f} "
                  f"of {fig['spec_decode_num_draft_tokens_total']:.0f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.spec_decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--engines", default="kvpool,kvpool-spec,vllm-spec,vllm",
                   help="comma-separated of kvpool, vllm, each alone or with -spec (n-gram drafts) or -suffix (suffix decoding)")
    p.add_argument("--out", type=Path, default=ROOT / "out" / "spec-decode")
    a = p.parse_args(argv)
    a.out = a.out.resolve()
    a.out.mkdir(parents=True, exist_ok=True)
    model = smollm2_checkpoint()
    from transformers import AutoTokenizer

    data = copy_dataset(sharegpt_json(a.out / "sharegpt.json"), a.out / "copy.jsonl", 64, AutoTokenizer.from_pretrained(model))
    cfg = ServerConfig(dtype="bfloat16")
    engines = a.engines.split(",")
    results: dict = {e: {int(c): [] for c in a.concurrency.split(",")} for e in engines}
    for rep in range(a.repeat):
        for engine in engines if rep % 2 == 0 else reversed(engines):
            run_engine(engine, rep, model, cfg, data, a, results[engine])
    (a.out / "result.json").write_text(json.dumps(results, indent=1))
    print("\n| engine | conc | tok/s (median) | TPOT p50 ms | acceptance rate | mean acceptance length | prefix queries / hits |")
    print("|---|---|---|---|---|---|---|")
    for engine, by_c in results.items():
        for c, runs in by_c.items():
            tok = statistics.median(r["output_throughput"] for r in runs)
            tpot = statistics.median(r["median_tpot_ms"] for r in runs)
            drafts = sum(r["spec_decode_num_drafts_total"] for r in runs)
            dt = sum(r["spec_decode_num_draft_tokens_total"] for r in runs)
            acc = sum(r["spec_decode_num_accepted_tokens_total"] for r in runs)
            rate = f"{acc / dt:.1%}" if dt else "-"
            mal = f"{1 + acc / drafts:.2f}" if drafts else "-"
            queries = sum(r["prefix_cache_queries_total"] for r in runs)
            hits = sum(r["prefix_cache_hits_total"] for r in runs)
            print(f"| {engine} | {c} | {tok:.1f} | {tpot:.1f} | {rate} | {mal} | {queries:,.0f} / {hits:,.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
