"""The external KV tiers on multi-turn chats (issue #50): ``python -m bench.external_tier_bench``.

SmolLM2-135M-Instruct (bfloat16) under ``kvpool serve`` with a device pool far smaller than
the chats' working set, and each tier below it, one service at a time:

* ``none``: the device pool alone;
* ``memory``: the host tier (``--kv-offloading-size``) of twice the device pool's blocks
  (on a CPU host the same DRAM: it buys capacity by splitting one budget);
* ``disk``: a directory (``--kv-offloading-backend disk``), bounded at 1 GiB;
* ``mooncake``: a Mooncake Store (``--kv-offloading-backend mooncake``), its master and a
  store server holding the memory started here on loopback (bench/external_store_io.py).

Each service runs the same chats three times (kvpool's load generator's ``multiturn``:
users chatting at once, each round resending the history; greedy, the client's default
otherwise): *cold* (a new service, an empty tier), *warm* (the same chats again on the same
service), then the whole service is killed with SIGKILL, started again on the same
directory or store, and runs them a third time (*restarted*). For each run: the hit rate
(device and tier hits over the tokens looked up, from the scheduler's /metrics), the
cached tokens the clients were told of (usage), and TTFT p50 / p99.

Targets: each tier's cold hit rate at least twice no tier's, with a lower TTFT p50; after
the restart, at least 90% of the cached tokens the warm run got.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from bench.compare.servers import Server, free_port
from bench.real_model import sharegpt_json, smollm2_checkpoint
from bench.table import Row, print_table

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ("none", "memory", "disk", "mooncake")
BLOCK_SIZE = 16
# SmolLM2-135M's KV block in bfloat16: 30 layers x K and V x 3 KV heads x 64 x 16 tokens x 2 bytes.
BLOCK_BYTES = 30 * 2 * 3 * 64 * BLOCK_SIZE * 2


@dataclass
class RunFigures:
    hit_rate: float
    cached_tokens: int
    queried_tokens: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    failed: int


def scrape(url: str) -> dict[str, float]:
    """The scheduler's counters kvpool serve's /metrics shows (labels dropped, summed)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def serve_flags(backend: str, args: argparse.Namespace, work: Path, store) -> list[str]:
    flags = ["--num-gpu-blocks-override", str(args.device_blocks), "--max-model-len", str(args.max_model_len),
             "--enable-prompt-tokens-details"]
    if backend == "memory":
        flags += ["--kv-offloading-size", f"{2 * args.device_blocks * BLOCK_BYTES / 2**30:.6f}"]
    elif backend == "disk":
        flags += ["--kv-offloading-backend", "disk", "--kv-offloading-path", str(work / "disk"), "--kv-offloading-disk-size", "1"]
    elif backend == "mooncake":
        flags += ["--kv-offloading-backend", "mooncake", "--mooncake-master", store.master_address, "--mooncake-metadata", store.metadata_server]
    return flags


def start(model: Path, backend: str, args: argparse.Namespace, work: Path, store, name: str) -> Server:
    port = free_port()
    cmd = [str(ROOT / ".venv/bin/kvpool"), "serve", str(model), "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "smollm2",
           "--log-dir", str(work / f"logs-{name}"), *serve_flags(backend, args, work, store)]
    server = Server(f"kvpool-{backend}", cmd, {}, work / f"{name}.log", port)
    server.__enter__()
    server.wait_ready(300)
    return server


def run_chats(server: Server, model: Path, chats: Path, args: argparse.Namespace, out: Path) -> RunFigures:
    before = scrape(server.url)
    cmd = [sys.executable, "-m", "loadgen", "--backend", "openai-chat", "--base-url", server.url, "--model", "smollm2",
           "--tokenizer", str(model), "--dataset", "multiturn", "--dataset-path", str(chats), "--num-users", str(args.users),
           "--num-rounds", str(args.rounds), "--output-len", str(args.output_len), "--system-prompt-words", str(args.system_prompt_words),
           "--seed", "1", "--result-json", str(out)]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, timeout=1800)
    after = scrape(server.url)
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    queries = d.get("vllm:prefix_cache_queries_total", 0.0)
    hits = d.get("vllm:prefix_cache_hits_total", 0.0) + d.get("vllm:external_prefix_cache_hits_total", 0.0)
    result = json.loads(out.read_text())
    ttft = result["ttft_ms"]
    cached = round((result.get("client_cached_token_frac") or 0.0) * result["total_input_tokens"])
    return RunFigures(hits / queries if queries else 0.0, cached, int(queries),
                      ttft["median"], ttft["p99"], int(result["failed"]))


def kill_service(server: Server) -> None:
    """SIGKILL to the whole service (kvpool serve and its children), nothing flushed."""
    os.killpg(server.proc.pid, signal.SIGKILL)
    server.proc.wait(10)
    server.stop()


def measure(backend: str, model: Path, chats: Path, args: argparse.Namespace, work: Path) -> dict[str, RunFigures]:
    work.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        store = None
        if backend == "mooncake":
            from bench.external_store_io import MooncakeMaster

            store = stack.enter_context(MooncakeMaster(work))
        server = start(model, backend, args, work, store, "first")
        stack.callback(server.stop)
        figures = {"cold": run_chats(server, model, chats, args, work / "cold.json")}
        figures["warm"] = run_chats(server, model, chats, args, work / "warm.json")
        time.sleep(2.0)  # NOTE: the last saves run off the step path; a user's kill comes later than the last answer
        kill_service(server)
        server = start(model, backend, args, work, store, "restarted")
        stack.callback(server.stop)
        figures["restarted"] = run_chats(server, model, chats, args, work / "restarted.json")
    return figures


def rows(results: dict[str, dict[str, RunFigures]]) -> list[Row]:
    out = []
    base = results.get("none")
    for backend, figs in results.items():
        cold, warm, again = figs["cold"], figs["warm"], figs["restarted"]
        tier = backend != "none" and base is not None
        out.append(Row(f"{backend}: cold hit rate", cold.hit_rate, "",
                       ">= 2x none" if tier else "", cold.hit_rate >= 2 * base["cold"].hit_rate if tier else None))
        out.append(Row(f"{backend}: cold TTFT p50 (ms)", cold.ttft_p50_ms, "",
                       "< none" if tier else "", cold.ttft_p50_ms < base["cold"].ttft_p50_ms if tier else None))
        out.append(Row(f"{backend}: cold TTFT p99 (ms)", cold.ttft_p99_ms, "", "", None))
        out.append(Row(f"{backend}: warm hit rate", warm.hit_rate, "", "", None))
        ratio = again.cached_tokens / warm.cached_tokens if warm.cached_tokens else 0.0
        persistent = backend in ("disk", "mooncake")
        out.append(Row(f"{backend}: cached tokens after kill -9 / warm run's", ratio, "",
                       ">= 0.9" if persistent else "", ratio >= 0.9 if persistent else None))
        out.append(Row(f"{backend}: restarted TTFT p50 (ms)", again.ttft_p50_ms, "", "", None))
        failed = cold.failed + warm.failed + again.failed
        if failed:
            out.append(Row(f"{backend}: FAILED requests", failed, "", "0", False))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default=",".join(BACKENDS), help="comma list of: " + ", ".join(BACKENDS))
    p.add_argument("--out", type=Path, default=ROOT / "out" / "external-tier")
    # NOTE: 12 users x 4 rounds: about 525 blocks of distinct history, 5.5x the default pool,
    # whose 96 blocks still hold the longest prompt.
    p.add_argument("--users", type=int, default=12)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--output-len", type=int, default=48)
    # NOTE: the load generator's default, 400 words every user shares, is most of the reuse and the
    # device keeps it: a short one leaves each user's history as the reuse a tier may serve.
    p.add_argument("--system-prompt-words", type=int, default=400)
    p.add_argument("--device-blocks", type=int, default=96, help="the device pool, in blocks (default %(default)s)")
    p.add_argument("--max-model-len", type=int, default=1536)
    args = p.parse_args(argv)
    backends = args.backends.split(",")
    if unknown := set(backends) - set(BACKENDS):
        p.error(f"unknown backends {sorted(unknown)}; choose from {', '.join(BACKENDS)}")
    model = smollm2_checkpoint()
    chats = sharegpt_json(args.out / "sharegpt.json")
    results = {b: measure(b, model, chats, args, args.out / b) for b in backends}
    (args.out / "results.json").write_text(json.dumps({b: {k: vars(v) for k, v in f.items()} for b, f in results.items()}, indent=2))
    print_table(rows(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
