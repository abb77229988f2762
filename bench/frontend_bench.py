"""The frontend's cost (``python -m bench frontend``): one scheduler, one worker (the
tiny checkpoint, CPU) and one frontend, started here, driven two ways in
interleaved rounds over the same workload.

* TPOT at 64 concurrent streams (64 random 32-token prompts, 64 tokens out, greedy,
  ignore_eos) through ``/v1/completions`` (the HTTP load generator: SSE, usage)
  against the native client on the scheduler's port. Target: ≤ 1.1×.
* The frontend process's CPU time per streamed token over those HTTP rounds (context:
  the part of the overhead that is the server's, not its client's), and the load
  generator's own (this process) per token on each path: what the HTTP client's SSE
  and JSON parsing costs beside the native client's msgspec frames.
* Tiny non-streamed completions (8-token prompt, 1 token out) the frontend sustains,
  64 in flight: requests per second (context only).

NOTE: on the 2-core development machine the load generator, the frontend, the
scheduler and the worker share the cores, so the HTTP path also pays for its
client's JSON parsing. Each round runs both paths back to back (which goes first
alternates) and the ratio is the median of the rounds' own ratios, so load that
comes and goes between rounds (other work on the machine) cancels within a round;
the rounds' lowest and highest ratio are shown beside it.
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np

from bench.health import wait_healthy
from bench.table import Row
from loadgen.datasets import random_requests
from loadgen.openai_client import OpenAIClient
from loadgen.report import summarize
from loadgen.runner import run_benchmark

STREAMS, PROMPT_LEN, OUTPUT_LEN, ROUNDS = 64, 32, 64, 5
TPOT_RATIO_TARGET = 1.1


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _free_ports(n: int) -> list[int]:
    from frontend.serve.launcher import free_ports

    return free_ports(n)


class Stack:
    """Scheduler + worker + frontend as three processes, stopped on exit."""

    def __init__(self, model: Path):
        self.client_port, worker_port, self.http_port, self.api_port = _free_ports(4)
        py = sys.executable
        quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
        self.procs = [
            subprocess.Popen([py, "-m", "scheduler", "--port", str(self.client_port), "--worker-port", str(worker_port),
                              "--http-port", str(self.http_port), "--max-num-seqs", "128", "--max-model-len", "1024"], **quiet),
            subprocess.Popen([py, "-m", "worker", "--scheduler", f"tcp://127.0.0.1:{worker_port}", "--model", str(model),
                              "--device", "cpu", "--kv-cache-memory", "64MiB", "--http-port", "0"], **quiet),
            subprocess.Popen([py, "-m", "frontend", "--model", str(model), "--port", str(self.api_port), "--max-model-len", "1024",
                              "--scheduler", f"tcp://127.0.0.1:{self.client_port}",
                              "--scheduler-http", f"http://127.0.0.1:{self.http_port}"], **quiet),
        ]
        self.base_url = f"http://127.0.0.1:{self.api_port}"

    def wait_ready(self, timeout: float = 120.0) -> None:
        wait_healthy(self.base_url, self.procs, "the bench's scheduler/worker/frontend", timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _median_tpot_ms(stack: Stack, http: bool) -> float:
    requests = random_requests(STREAMS, PROMPT_LEN, OUTPUT_LEN, 0.0, 512, seed=int(time.time()))
    client = OpenAIClient(stack.base_url, "/v1/completions", None, chat=False) if http else None
    outcome = asyncio.run(run_benchmark(
        requests, np.zeros(STREAMS), scheduler=f"tcp://127.0.0.1:{stack.client_port}", metrics_url=None, ignore_eos=True,
        max_concurrency=STREAMS, request_timeout=300, client=client,
    ))
    s = summarize(outcome.results, outcome.duration_s)
    if s["failed"]:
        raise RuntimeError(f"{s['failed']} requests failed: {s['errors']}")
    return s["tpot_ms"]["median"]


async def _tiny_rps(base_url: str, total: int = 600, concurrency: int = 64) -> float:
    body = {"prompt": [5, 6, 7, 8, 9, 10, 11, 12], "max_tokens": 1, "temperature": 0}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        model = (await (await session.get(base_url + "/v1/models")).json())["data"][0]["id"]
        body["model"] = model
        left = total

        async def worker():
            nonlocal left
            while left > 0:
                left -= 1
                async with session.post(base_url + "/v1/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    await r.read()

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return total / (time.perf_counter() - t0)


def rows() -> list[Row]:
    from worker.tiny.generate import default_checkpoint

    with Stack(default_checkpoint()) as stack:
        stack.wait_ready()
        _median_tpot_ms(stack, http=False)  # warm-up: first passes over fresh memory are slow
        native, http = [], []
        frontend_cpu, client_cpu = 0.0, {False: 0.0, True: 0.0}
        for r in range(ROUNDS):
            for is_http in (False, True) if r % 2 == 0 else (True, False):
                t0, c0 = time.process_time(), _cpu_s(stack.procs[2].pid)
                (http if is_http else native).append(_median_tpot_ms(stack, http=is_http))
                client_cpu[is_http] += time.process_time() - t0
                if is_http:
                    frontend_cpu += _cpu_s(stack.procs[2].pid) - c0
        rps = asyncio.run(_tiny_rps(stack.base_url))
    n, h = statistics.median(native), statistics.median(http)
    ratios = [b / a for a, b in zip(native, http, strict=True)]
    ratio = statistics.median(ratios)
    per_token = 1e6 / (ROUNDS * STREAMS * OUTPUT_LEN)
    return [
        Row(f"TPOT, {STREAMS} streams, native client", n, "ms"),
        Row(f"TPOT, {STREAMS} streams, /v1/completions (SSE)", h, "ms"),
        Row(f"frontend TPOT overhead (HTTP / native), median of {ROUNDS} rounds", ratio, "x", f"≤ {TPOT_RATIO_TARGET:g}x",
            ratio <= TPOT_RATIO_TARGET),
        Row("  lowest round's ratio", min(ratios), "x"),
        Row("  highest round's ratio", max(ratios), "x"),
        Row("frontend CPU per streamed token, 64 streams", frontend_cpu * per_token, "us"),
        Row("load generator CPU per token, native client", client_cpu[False] * per_token, "us"),
        Row("load generator CPU per token, HTTP client", client_cpu[True] * per_token, "us"),
        Row("tiny non-streamed completions, 64 in flight", rps, "r/s"),
    ]


if __name__ == "__main__":
    from bench.table import print_table

    print_table(rows())
