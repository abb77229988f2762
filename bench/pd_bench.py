"""P/D disaggregation measured live (docs/pd-disaggregation.md): `kvpool serve` engines
behind vllm-router's PD mode against one engine.

* ``agreement``: greedy outputs through 1P1D and 2P1D equal one engine's, prompt for
  prompt (float32; the tiny checkpoint's random token prompts, or SmolLM2's ShareGPT first
  turns).
* ``latency``: the load disaggregation exists for. Decode streams run all along (short
  prompts, long answers, a closed loop) while long prompts arrive every few seconds; TTFT
  and TPOT p50/p99 of each kind, and the decode streams' inter-token latency p99, for 1P1D
  (each engine pinned to a core of its own) against one engine given both cores.

    python -m bench.pd_bench agreement --model tiny --num-prompts 64
    python -m bench.pd_bench agreement --model smollm2 --num-prompts 64
    python -m bench.pd_bench latency --model smollm2 --duration 40
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import threading
import time
import urllib.request
from pathlib import Path

from bench.pd_fleet import PDFleet
from bench.replicas import Replica


def model_path(name: str) -> Path:
    if name == "tiny":
        from worker.tiny.generate import default_checkpoint

        return default_checkpoint()
    from bench.real_model import smollm2_checkpoint

    return smollm2_checkpoint()


def prompts_for(name: str, n: int, seed: int = 1) -> list:
    rng = random.Random(seed)
    if name == "tiny":
        return [[rng.randrange(2, 500) for _ in range(rng.randrange(5, 300))] for _ in range(n)]
    from loadgen.sharegpt import installed_sharegpt, read_sharegpt

    turns = [c["conversations"][0]["value"] for c in read_sharegpt(installed_sharegpt()) if c.get("conversations")]
    turns = [t[:1500] for t in turns if len(t) > 20]
    return rng.sample(turns, n)


def complete(url: str, prompt, max_tokens: int, timeout: float = 300.0) -> list[int]:
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)["choices"][0]["token_ids"]


def pin_group(pgid: int, core: int) -> None:
    """Every thread of every process of session ``pgid`` onto ``core`` (an engine on a core of its own)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) != pgid:
                continue
            for task in (stat.parent / "task").iterdir():
                os.sched_setaffinity(int(task.name), {core})
        except (OSError, ValueError, IndexError):
            continue


def agreement(a) -> dict:
    model, work = model_path(a.model), Path(a.out) / f"agreement-{a.model}"
    common = ("--served-model-name", "m", "--dtype", "float32", "--num-gpu-blocks-override", str(a.num_blocks), "--max-model-len", "2048")
    batch = prompts_for(a.model, a.num_prompts)
    one = Replica(model, work / "one", *common)
    try:
        one.wait_ready(300)
        reference = [complete(one.url, p, a.max_tokens) for p in batch]
    finally:
        one.stop()
    out = {"model": a.model, "num_prompts": len(batch), "max_tokens": a.max_tokens}
    for layout in a.layouts.split(","):
        num_p, num_d = (int(x) for x in layout.lower().replace("p", " ").replace("d", " ").split())
        fleet = PDFleet(model, work / layout, num_p, num_d, *common)
        try:
            got = [complete(fleet.url, p, a.max_tokens) for p in batch]
        finally:
            fleet.stop()
        out[layout] = sum(g == r for g, r in zip(got, reference, strict=True))
        print(f"{a.model} {layout}: {out[layout]} of {len(batch)} greedy outputs equal one engine's", flush=True)
    return out


def stream(url: str, prompt, max_tokens: int) -> tuple[float, list[float], int]:
    """(TTFT, the gaps between tokens, the prompt's tokens) of one streamed completion, in seconds."""
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    times, num_prompt = [], 0
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                num_prompt = chunk["usage"]["prompt_tokens"]
            if chunk["choices"] and chunk["choices"][0]["text"]:
                times.append(time.perf_counter())
    return times[0] - t0, [b - a for a, b in zip(times, times[1:], strict=False)], num_prompt


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(1000 * xs[min(len(xs) - 1, int(q * len(xs)))], 2) if xs else float("nan")


def run_load(url: str, a, rng: random.Random) -> tuple[dict, list[dict]]:
    """The figures of one run, and its requests (kind, sent at, prompt and output tokens)."""
    stop = threading.Event()
    done: list[dict] = []
    lock = threading.Lock()
    start = time.perf_counter()

    def record(kind: str, sent: float, max_tokens: int, r) -> None:
        ttft, gaps, num_prompt = r
        with lock:
            done.append({"kind": kind, "sent_s": sent - start, "prompt_tokens": num_prompt, "output_tokens": max_tokens,
                         "ttft": ttft, "gaps": gaps})

    def decoder():
        while not stop.is_set():
            prompt = [rng.randrange(2, 400) for _ in range(32)] if a.model == "tiny" else "Tell me a long story about a cat."
            sent = time.perf_counter()
            record("decode", sent, a.decode_tokens, stream(url, prompt, a.decode_tokens))

    def prefiller():
        while not stop.wait(a.long_every):
            words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "omega"]) for _ in range(a.long_words))
            sent = time.perf_counter()
            record("long", sent, 8, stream(url, words, 8))

    threads = [threading.Thread(target=decoder, daemon=True) for _ in range(a.decoders)] + [threading.Thread(target=prefiller, daemon=True)]
    for t in threads:
        t.start()
    time.sleep(a.duration)
    stop.set()
    for t in threads:
        t.join(600)
    return figures(done, time.perf_counter() - start), done


def figures(done: list[dict], seconds: float) -> dict:
    """TTFT and TPOT p50/p99 of each kind, the decode streams' inter-token latency (p50, p99,
    p99.9, max, and how many gaps were stalls over 100 ms), output tok/s."""
    decode = [d for d in done if d["kind"] == "decode"]
    long = [d for d in done if d["kind"] == "long"]
    gaps = [g for d in decode for g in d["gaps"]]
    tpot = [statistics.mean(d["gaps"]) for d in decode if d["gaps"]]
    return {"decode_requests": len(decode), "long_requests": len(long),
            "decode_itl_p50_ms": pct(gaps, 0.5), "decode_itl_p99_ms": pct(gaps, 0.99), "decode_itl_p999_ms": pct(gaps, 0.999),
            "decode_itl_max_ms": pct(gaps, 1.0), "decode_stalls_over_100ms": sum(g > 0.1 for g in gaps),
            "decode_tpot_p50_ms": pct(tpot, 0.5), "decode_tpot_p99_ms": pct(tpot, 0.99),
            "decode_ttft_p50_ms": pct([d["ttft"] for d in decode], 0.5), "decode_ttft_p99_ms": pct([d["ttft"] for d in decode], 0.99),
            "long_ttft_p50_ms": pct([d["ttft"] for d in long], 0.5), "long_ttft_p99_ms": pct([d["ttft"] for d in long], 0.99),
            "long_prompt_tokens": statistics.mean([d["prompt_tokens"] for d in long]) if long else 0,
            **{f"all_{k}": v for k, v in aggregate(done).items()},
            "output_tok_s": sum(len(d["gaps"]) + 1 for d in done) / seconds}


def aggregate(done: list[dict]) -> dict:
    """Over every request, as the simulator reports a run: TTFT, TPOT (a request's mean gap), ITL (every gap)."""
    gaps = [g for d in done for g in d["gaps"]]
    tpot = [statistics.mean(d["gaps"]) for d in done if d["gaps"]]
    ttft = [d["ttft"] for d in done]
    return {"ttft_p50_ms": pct(ttft, 0.5), "ttft_p99_ms": pct(ttft, 0.99), "tpot_p50_ms": pct(tpot, 0.5),
            "tpot_p99_ms": pct(tpot, 0.99), "itl_p50_ms": pct(gaps, 0.5), "itl_p99_ms": pct(gaps, 0.99)}


def write_trace(done: list[dict], path: Path) -> None:
    """The run's requests as a Mooncake trace (the simulator's input): when each was sent,
    its prompt and output tokens, a hash id per 512 tokens (none shared)."""
    next_id = 0
    with open(path, "w") as f:
        for d in sorted(done, key=lambda d: d["sent_s"]):
            n = max(1, -(-d["prompt_tokens"] // 512))
            f.write(json.dumps({"timestamp": round(d["sent_s"] * 1000), "input_length": d["prompt_tokens"],
                                "output_length": d["output_tokens"], "hash_ids": list(range(next_id, next_id + n))}) + "\n")
            next_id += n


def latency(a) -> dict:
    model, work = model_path(a.model), Path(a.out) / f"latency-{a.model}"
    common = ("--served-model-name", "m", "--dtype", a.dtype, "--num-gpu-blocks-override", str(a.num_blocks), "--max-model-len", "4096")
    out = {"model": a.model, "dtype": a.dtype, "settings": vars(a)}
    for repeat in range(a.repeat):
        for layout in ("one", "1p1d"):
            rng = random.Random(repeat)
            if layout == "one":
                engine = Replica(model, work / f"one{repeat}", *common)
                try:
                    engine.wait_ready(300)
                    complete(engine.url, "warm up", 4)
                    result, done = run_load(engine.url, a, rng)
                finally:
                    engine.stop()
            else:
                fleet = PDFleet(model, work / f"pd{repeat}", 1, 1, *common)
                try:
                    for core, r in enumerate(fleet.engines):
                        pin_group(r.proc.pid, core % os.cpu_count())
                    complete(fleet.url, "warm up", 4)
                    result, done = run_load(fleet.url, a, rng)
                finally:
                    fleet.stop()
            write_trace(done, work / f"{layout}{repeat}.jsonl")
            out.setdefault(layout, []).append(result)
            print(layout, json.dumps(result), flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("agreement", "latency"))
    p.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--layouts", default="1p1d,2p1d")
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--duration", type=float, default=40.0)
    p.add_argument("--decoders", type=int, default=4)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--long-every", type=float, default=3.0)
    p.add_argument("--long-words", type=int, default=1200)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--out", default="out/pd")
    a = p.parse_args(argv)
    result = agreement(a) if a.what == "agreement" else latency(a)
    path = Path(a.out) / f"{a.what}-{a.model}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"written {path}")


if __name__ == "__main__":
    main()
