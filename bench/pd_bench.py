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
from bench.router_bench import Replica


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


def stream(url: str, prompt, max_tokens: int) -> tuple[float, list[float]]:
    """(TTFT, the gaps between tokens) of one streamed completion, in seconds."""
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    times = []
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if line.startswith(b"data: {") and json.loads(line[6:])["choices"][0]["text"]:
                times.append(time.perf_counter())
    return times[0] - t0, [b - a for a, b in zip(times, times[1:], strict=False)]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return 1000 * xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def run_load(url: str, a, rng: random.Random) -> dict:
    stop = threading.Event()
    decode, long = [], []  # (ttft, gaps)
    lock = threading.Lock()

    def decoder():
        while not stop.is_set():
            r = stream(url, [rng.randrange(2, 400) for _ in range(32)] if a.model == "tiny" else "Tell me a long story about a cat.",
                       a.decode_tokens)  # fmt: skip
            with lock:
                decode.append(r)

    def prefiller():
        while not stop.wait(a.long_every):
            words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "omega"]) for _ in range(a.long_words))
            r = stream(url, words, 8)
            with lock:
                long.append(r)

    threads = [threading.Thread(target=decoder, daemon=True) for _ in range(a.decoders)] + [threading.Thread(target=prefiller, daemon=True)]
    for t in threads:
        t.start()
    time.sleep(a.duration)
    stop.set()
    for t in threads:
        t.join(600)
    gaps = [g for _, gs in decode for g in gs]
    tpot = [statistics.mean(gs) for _, gs in decode if gs]
    return {"decode_requests": len(decode), "long_requests": len(long),
            "decode_itl_p50_ms": pct(gaps, 0.5), "decode_itl_p99_ms": pct(gaps, 0.99),
            "decode_tpot_p50_ms": pct(tpot, 0.5), "decode_tpot_p99_ms": pct(tpot, 0.99),
            "decode_ttft_p50_ms": pct([t for t, _ in decode], 0.5), "decode_ttft_p99_ms": pct([t for t, _ in decode], 0.99),
            "long_ttft_p50_ms": pct([t for t, _ in long], 0.5), "long_ttft_p99_ms": pct([t for t, _ in long], 0.99),
            "output_tok_s": (sum(len(gs) + 1 for _, gs in decode) + 8 * len(long)) / a.duration}  # fmt: skip


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
                    result = run_load(engine.url, a, rng)
                finally:
                    engine.stop()
            else:
                fleet = PDFleet(model, work / f"pd{repeat}", 1, 1, *common)
                try:
                    for core, r in enumerate(fleet.engines):
                        pin_group(r.proc.pid, core % os.cpu_count())
                    complete(fleet.url, "warm up", 4)
                    result = run_load(fleet.url, a, rng)
                finally:
                    fleet.stop()
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
