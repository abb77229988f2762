"""lm-evaluation-harness against a live server, with no download: two local tasks (a
multiple-choice one, scored by loglikelihood, and a generation one) written as YAML
beside their JSONL data, run by ``lm_eval`` 0.4's ``local-completions`` model, which
scores each choice through ``/v1/completions`` with echo, logprobs 1 and max_tokens 1
(the prompt tokens' logprobs: vLLM's prompt_logprobs).

``samples(...)`` returns what the harness logged per document: each multiple-choice
document's per-choice loglikelihoods, each generation document's text. The same run
against vLLM and kvpool on one checkpoint must give the same loglikelihoods
(``bench.compare``'s lm-eval row; ``tests/bench/compare/test_lm_eval_tasks.py``).

    python -m bench.compare.lm_eval_tasks --url http://127.0.0.1:8000 --model NAME --tokenizer CHECKPOINT
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

MC_TASK, GEN_TASK = "kvpool_mc", "kvpool_gen"
LM_EVAL = "lm-eval"  # bench.compare's results key and row
GOAL = 1e-3  # per-choice loglikelihoods, float32
MC_DOCS = [
    {"question": "The cat sat on the", "choices": ["mat", "moon", "table"], "answer": 0},
    {"question": "Blocks of KV memory are owned by the", "choices": ["scheduler", "worker", "client"], "answer": 0},
    {"question": "A prefix cache hit saves", "choices": ["compute", "nothing", "disk space"], "answer": 0},
    {"question": "Two plus two is", "choices": ["four", "five", "twenty two"], "answer": 0},
]
GEN_DOCS = [
    {"prompt": "Once upon a time", "target": " there"},
    {"prompt": "The scheduler owns every block", "target": " of"},
]
# NOTE: YAML is JSON's superset: the configs are written with json.dumps, no yaml dependency.
_MC_CONFIG = {
    "task": MC_TASK, "dataset_path": "json", "test_split": "test", "output_type": "multiple_choice",
    "doc_to_text": "Q: {{question}}\nA:", "doc_to_choice": "{{choices}}", "doc_to_target": "{{answer}}",
    "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
}
_GEN_CONFIG = {
    "task": GEN_TASK, "dataset_path": "json", "test_split": "test", "output_type": "generate_until",
    "doc_to_text": "{{prompt}}", "doc_to_target": "{{target}}",
    "generation_kwargs": {"until": ["\n"], "max_gen_toks": 8, "do_sample": False, "temperature": 0},
    "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
}


def write_tasks(directory: Path) -> Path:
    """The two tasks' YAML and JSONL in ``directory`` (data paths absolute: the
    harness resolves them from its working directory)."""
    directory.mkdir(parents=True, exist_ok=True)
    for task, docs, config in ((MC_TASK, MC_DOCS, _MC_CONFIG), (GEN_TASK, GEN_DOCS, _GEN_CONFIG)):
        data = directory / f"{task}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        config = config | {"dataset_kwargs": {"data_files": {"test": str(data.resolve())}}}
        (directory / f"{task}.yaml").write_text(json.dumps(config, indent=1) + "\n")
    return directory


def run(url: str, model: str, tokenizer: str, out: Path, timeout: float = 600.0) -> Path:
    """Run both tasks against ``url`` (a server's root), samples logged under ``out``."""
    tasks = write_tasks(out / "tasks")
    model_args = ",".join([f"base_url={url}/v1/completions", f"model={model}", "tokenizer_backend=huggingface",
                           f"tokenizer={tokenizer}", "num_concurrent=1", "max_retries=1", "tokenized_requests=True"])
    argv = [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args", model_args,
            "--tasks", f"{MC_TASK},{GEN_TASK}", "--include_path", str(tasks), "--output_path", str(out / "results"),
            "--log_samples", "--batch_size", "1", "--seed", "0"]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"lm_eval exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return out / "results"


def read_samples(results: Path) -> dict:
    """{"mc": per document, its choices' loglikelihoods; "gen": per document, its text}."""
    found = {}
    for task in (MC_TASK, GEN_TASK):
        (path,) = sorted(results.rglob(f"samples_{task}_*.jsonl"))[-1:]
        docs = sorted((json.loads(line) for line in path.read_text().splitlines() if line), key=lambda s: s["doc_id"])
        found[task] = docs
    mc = [[float(r[0][0]) for r in d["resps"]] for d in found[MC_TASK]]
    gen = [d["resps"][0][0] for d in found[GEN_TASK]]
    return {"mc": mc, "gen": gen}


def samples(url: str, model: str, tokenizer: str, out: Path, timeout: float = 600.0) -> dict:
    return read_samples(run(url, model, tokenizer, out, timeout))


def max_difference(a: dict, b: dict) -> float:
    """The largest |Δ| between two runs' per-choice loglikelihoods."""
    pairs = [(x, y) for da, db in zip(a["mc"], b["mc"], strict=True) for x, y in zip(da, db, strict=True)]
    return max(abs(x - y) for x, y in pairs)


def compare_samples(url: str, model: str, tokenizer: str, out: Path, timeout: float) -> dict:
    """``samples``, or {"error": why} (one engine failing leaves the rest of bench.compare's table)."""
    try:
        return samples(url, model, tokenizer, out, timeout)
    except (RuntimeError, subprocess.TimeoutExpired, ValueError) as e:
        print(f"compare: lm-eval against {url} failed: {e}", file=sys.stderr, flush=True)
        return {"error": str(e)}


def lm_eval_rows(got: dict) -> list[dict]:
    """bench.compare's rows: the largest per-choice loglikelihood difference (goal
    <= 1e-3), and the generation task's identical texts."""
    v, k = got.get("vllm", {}), got.get("kvpool", {})
    ok = "mc" in v and "mc" in k
    diff = max_difference(v, k) if ok else None
    same = sum(a == b for a, b in zip(v["gen"], k["gen"], strict=True)) / len(v["gen"]) if ok else None
    return [
        {"workload": LM_EVAL, "figure": "max |Δ loglikelihood| (float32)", "key": "max_loglikelihood_difference",
         "vllm": 0.0, "kvpool": diff, "ratio": None, "goal": f"<= {GOAL:g}", "met": None if diff is None else diff <= GOAL},
        {"workload": LM_EVAL, "figure": "generations identical", "key": "fraction_identical", "vllm": 1.0, "kvpool": same,
         "ratio": same, "goal": "", "met": None},
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compare.lm_eval_tasks", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="the server's root, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="the served model name")
    p.add_argument("--tokenizer", required=True, help="the checkpoint folder (the harness tokenizes with it)")
    p.add_argument("--out", type=Path, default=Path("lm-eval-out"))
    a = p.parse_args(argv)
    print(json.dumps(samples(a.url, a.model, a.tokenizer, a.out), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
