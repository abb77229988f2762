"""The workloads of ``make compare``, each driven by the same client against both servers:
vLLM's own ``vllm bench serve`` (from ``.venv-vllm``), and for greedy agreement a small
completions client here that asks for the sampled token ids.

* ``prefix-c8`` / ``prefix-c64``: ``--dataset-name prefix_repetition`` (4 prefixes of 256
  tokens, 32-token suffixes, 64 output tokens, ignore_eos), concurrency 8 and 64.
* ``small-pool``: the same shape with long outputs on a pool too small for the batch,
  so both engines must preempt.
* ``mooncake``: a slice of a Mooncake trace replayed by ``--dataset-name timed_trace``
  (vLLM 0.32 replays such traces), its lengths scaled down so that one 512-token hash
  id of the trace becomes one block here.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

BENCH_KEYS = ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
              "output_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
              "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms")
SMALL_OUTPUT_LEN = 256  # small-pool's output tokens: long enough that the pool must preempt


@dataclass(frozen=True)
class Workload:
    name: str
    pool: str  # which ServerConfig: "main" or "small"
    args: tuple[str, ...]  # vllm bench serve's dataset and load flags
    what: str = ""
    shared_prefix: bool = field(default=False)
    # "vllm": vllm bench serve runs it (args: its flags); "loadgen": kvpool's own load
    # generator (args: its flags), for the multi-turn chats vLLM's bench has no dataset for.
    client: str = "vllm"


def prefix_args(num_prompts: int, concurrency: int, output_len: int, seed: int, prefix_len: int = 256,
                suffix_len: int = 32) -> tuple[str, ...]:
    return ("--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(prefix_len),
            "--prefix-repetition-suffix-len", str(suffix_len), "--prefix-repetition-num-prefixes", "4",
            "--prefix-repetition-output-len", str(output_len), "--num-prompts", str(num_prompts),
            "--max-concurrency", str(concurrency), "--ignore-eos", "--seed", str(seed))


def sharegpt_args(path: Path, num_prompts: int, concurrency: int, seed: int) -> tuple[str, ...]:
    """``vllm bench serve --dataset-name sharegpt``: its own sampling and length filters,
    each conversation's first answer's length out (ignore_eos)."""
    return ("--dataset-name", "sharegpt", "--dataset-path", str(path), "--num-prompts", str(num_prompts),
            "--max-concurrency", str(concurrency), "--ignore-eos", "--seed", str(seed))


def multiturn_args(path: Path, users: int, rounds: int, output_len: int, seed: int) -> tuple[str, ...]:
    """kvpool's load generator's multi-turn chats (LMCache's multi-round QA): ``users``
    conversations at once, each ``rounds`` questions from ShareGPT after a shared system
    prompt, every round resending the history with the streamed answers, greedy."""
    return ("--dataset", "multiturn", "--dataset-path", str(path), "--num-users", str(users), "--num-rounds", str(rounds),
            "--output-len", str(output_len), "--seed", str(seed))


def mooncake_slice(trace: Path, out: Path, num_requests: int, scale: int, max_model_len: int, max_output: int) -> Path:
    """The first num_requests of trace that fit max_model_len once their lengths are
    divided by scale; one hash id of 512 tokens becomes 512 // scale tokens."""
    rows = []
    with open(trace) as f:
        for line in f:
            r = json.loads(line)
            inp = max(1, r["input_length"] // scale)
            outp = max(4, min(max_output, r["output_length"] // scale))
            if inp + outp > max_model_len:
                continue
            rows.append({"timestamp": r["timestamp"], "input_length": inp, "output_length": outp,
                         "hash_ids": r["hash_ids"]})
            if len(rows) == num_requests:
                break
    if not rows:
        raise ValueError(f"{trace}: no request fits --max-model-len {max_model_len} at 1/{scale} of its length")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def mooncake_args(path: Path, chunk: int, concurrency: int, time_scale: float) -> tuple[str, ...]:
    return ("--dataset-name", "timed_trace", "--dataset-path", str(path), "--timed-trace-chunk-hash-size", str(chunk),
            "--timed-trace-sec-multiplier", str(0.001 * time_scale), "--num-prompts", "1000000", "--max-concurrency", str(concurrency))


def default_workloads(a) -> list[Workload]:
    ws = [
        Workload("prefix-c8", "main", prefix_args(a.num_prompts, 8, 64, seed=1), "shared prefix, concurrency 8", True),
        Workload("prefix-c64", "main", prefix_args(max(a.num_prompts, 128), 64, 64, seed=2), "shared prefix, concurrency 64", True),
        Workload("small-pool", "small", prefix_args(a.num_prompts, a.small_concurrency, SMALL_OUTPUT_LEN, seed=3),
                 f"{a.small_num_blocks} blocks, 256 out, concurrency {a.small_concurrency}"),
    ]
    if a.num_kv_groups > 1 or "prefix-long" in a.workloads:
        # NOTE: prompts 8 windows of Gemma 3's tiny checkpoint long: most of each prompt's
        # sliding-window blocks are freed while it decodes, and hits need every group.
        ws.append(Workload("prefix-long", "main", prefix_args(a.num_prompts // 2, 8, 128, seed=4, prefix_len=1024, suffix_len=64),
                           "1,024-token prefixes, 64-token suffixes, 128 out, concurrency 8", True))
    if a.num_kv_groups > 1:
        # NOTE: vLLM refuses a pool that cannot hold one max_model_len request in every
        # group; 64 blocks over several groups leave max_model_len too short for it.
        if "small-pool" in a.workloads:
            raise ValueError(f"small-pool: not with {a.num_kv_groups} KV-cache groups (its pool cannot hold a max_model_len request in each)")
        ws = [w for w in ws if w.name != "small-pool"]
    if a.trace:
        scale = 512 // a.block_size
        path = mooncake_slice(Path(a.trace), a.out / "mooncake_slice.jsonl", a.trace_requests, scale, a.max_model_len, 64)
        ws.append(Workload("mooncake", "main", mooncake_args(path, a.block_size, 8, a.trace_time_scale),
                           f"{Path(a.trace).name}, first {a.trace_requests} fitting, lengths / {scale}"))
    return [w for w in ws if not a.workloads or w.name in a.workloads]


def repeated(w: Workload, rep: int) -> Workload:
    """Run ``rep`` of a repeated workload: the same shape, the client's seed moved by
    1000 x rep, so each run's prompts are new and none hits the previous run's prefixes."""
    if rep == 0:
        return w
    args = list(w.args)
    if "--seed" not in args:
        raise ValueError(f"workload {w.name} has no --seed to vary between runs")
    i = args.index("--seed") + 1
    args[i] = str(int(args[i]) + 1000 * rep)
    return replace(w, args=tuple(args))


def combine_runs(runs: list[dict], counters: tuple[str, ...]) -> dict:
    """One engine's figures over repeated runs of a workload: the median of each of the
    bench's figures, the ``counters`` added up (equal prompts, equal sums), the highest
    peak KV usage."""
    out = {k: statistics.median(r[k] for r in runs) if all(r.get(k) is not None for r in runs) else None for k in BENCH_KEYS}
    out.update({c: sum(r[c] for r in runs) for c in counters})
    out["peak_kv_cache_usage_perc"] = max(r["peak_kv_cache_usage_perc"] for r in runs)
    exact = [r.get("peak_kv_cache_usage_since_start") for r in runs]
    out["peak_kv_cache_usage_since_start"] = max(exact) if None not in exact else None
    out["num_gpu_blocks"] = runs[0].get("num_gpu_blocks")
    return out


def bench_command(root: Path, url: str, model: Path, name: str, w: Workload, result: Path,
                  temperature: float | None = 0.0) -> list[str]:
    """``vllm bench serve``'s command line for one run of w, saving its JSON to result.
    ``temperature`` None sends none: the server's default sampling (temperature 1), as
    ``vllm bench serve`` does by default."""
    temp = [] if temperature is None else ["--temperature", f"{temperature:g}"]
    return [str(root / ".venv-vllm/bin/vllm"), "bench", "serve", "--backend", "vllm", "--base-url", url,
            "--endpoint", "/v1/completions", "--model", name, "--tokenizer", str(model), *temp,
            *w.args, "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--save-result", "--result-dir", str(result.parent), "--result-filename", result.name, "--disable-tqdm"]


def run_bench(root: Path, url: str, model: Path, name: str, w: Workload, out: Path, timeout_s: float,
              temperature: float | None = 0.0) -> dict:
    """One ``vllm bench serve`` run; its result JSON's figures (``temperature``: see
    bench_command)."""
    out.mkdir(parents=True, exist_ok=True)
    result = out / f"{w.name}.json"
    result.unlink(missing_ok=True)
    cmd = bench_command(root, url, model, name, w, result, temperature)
    # NOTE: timed_trace expands a hash id into tokens seeded by Python's hash() of a
    # string; a fixed PYTHONHASHSEED makes both engines see the same prompts.
    env = {**os.environ, "PYTHONHASHSEED": "0", "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}
    with open(out / f"{w.name}.log", "wb") as log:
        p = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout_s)
    if p.returncode != 0 or not result.exists():
        raise RuntimeError(f"vllm bench serve ({w.name}) failed with {p.returncode}; see {out / (w.name + '.log')}")
    data = json.loads(result.read_text())
    return {k: data.get(k) for k in BENCH_KEYS}


def run_loadgen(root: Path, url: str, model: Path, name: str, w: Workload, out: Path, timeout_s: float) -> dict:
    """One run of kvpool's load generator (``w.client`` "loadgen") through the chat API,
    its summary under vllm bench serve's names (BENCH_KEYS)."""
    out.mkdir(parents=True, exist_ok=True)
    result = out / f"{w.name}.json"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "loadgen", "--backend", "openai-chat", "--base-url", url, "--model", name,
           "--tokenizer", str(model), "--metrics-url", "", *w.args, "--result-json", str(result)]
    with open(out / f"{w.name}.log", "wb") as log:
        p = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s, cwd=root)
    if p.returncode not in (0, 1) or not result.exists():  # NOTE: 1: some request failed; the summary counts it
        raise RuntimeError(f"loadgen ({w.name}) failed with {p.returncode}; see {out / (w.name + '.log')}")
    s = json.loads(result.read_text())
    return {"completed": s["completed"], "failed": s["failed"], "duration": s["duration_s"],
            "total_input_tokens": s["total_input_tokens"], "total_output_tokens": s["total_output_tokens"],
            "request_throughput": s["request_throughput"], "output_throughput": s["output_throughput"],
            **{f"{stat}_{k}": (s[k] or {}).get(stat) for k in ("ttft_ms", "tpot_ms") for stat in ("mean", "median", "p99")}}


def shared_prefix_prompts(n: int, vocab: int, prefix_len: int, suffix_len: int, seed: int) -> list[list[int]]:
    """n prompts of token ids: 4 shared prefixes, then a suffix of each prompt's own (ids
    past the tiny tokenizer's 5 special tokens); prompt i takes prefix i % 4."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(5, vocab) for _ in range(prefix_len)] for _ in range(4)]
    return [prefixes[i % 4] + [rng.randrange(5, vocab) for _ in range(suffix_len)] for i in range(n)]


def agreement_prompts(n: int, vocab: int, seed: int = 7, window: int = 0) -> list[list[int]]:
    """The greedy-agreement prompts: 64-token prefixes, 16-token suffixes; with a sliding
    ``window``, prefixes of two windows (at least 64), so every prompt is longer than it."""
    return shared_prefix_prompts(n, vocab, max(64, 2 * window), 16, seed)


def greedy_token_ids(url: str, name: str, prompts: list[list[int]], max_tokens: int, timeout_s: float) -> list[list[int] | None]:
    """Each prompt's greedy completion as token ids (None where the request failed)."""

    def one(prompt: list[int]) -> list[int] | None:
        body = {"model": name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                "logprobs": 1, "return_tokens_as_token_ids": True}
        req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                tokens = json.loads(r.read())["choices"][0]["logprobs"]["tokens"]
            return [int(t.removeprefix("token_id:")) for t in tokens]
        except (OSError, ValueError, KeyError, TypeError):
            return None

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, prompts))


def agreement(ids: dict[str, list]) -> dict:
    """How many greedy outputs are the same on both engines."""
    v, k = ids["vllm"], ids["kvpool"]
    same = sum(1 for x, y in zip(v, k, strict=True) if x is not None and x == y)
    return {"dtype": "float32", "num_requests": len(v), "num_identical": same,
            "num_failed": sum(1 for x, y in zip(v, k, strict=True) if x is None or y is None),
            "fraction_identical": same / len(v) if v else None}
