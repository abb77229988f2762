"""Retention, live = simulated to the counter: a slice of each Mooncake trace (the
conversation and the synthetic one) through the simulator and through the live service
(scheduler + worker of the tiny checkpoint), for every --kv-eviction-policy at three
pool sizes that each evict. ``python -m bench retention_live`` prints the table.

Both sides get the same requests: the simulator's own trace loader (TraceWorkload) with
prompts cut at the slice's max input length (the simulator's --max-input-len) and one output token;
live, the same records expanded to token ids by the loader's own `expand_hash_ids`, sent
one at a time (each ends before the next starts, as the simulator's arrivals one second
apart with --max-num-seqs 1 make it), so the pool sees one order of allocations and frees.
Each row compares the scheduler's /metrics counters (vllm:prefix_cache_queries_total,
vllm:prefix_cache_hits_total, kvpool_evictions_total) with the simulation's.
"""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path

import zmq

from bench.health import wait_healthy
from bench.table import Row
from loadgen.datasets import MooncakeRecord, expand_hash_ids, load_mooncake_trace
from protocol.client_messages import ClientResponse, EngineCoreOutputs, Generate, RequestError
from protocol.codec import Codec
from simulator.config import SimConfig
from simulator.replay import simulate
from simulator.workload import TraceWorkload

# NOTE: the traces sit beside the checkout (/work/shared beside /work/main); a worktree one level deeper finds them at /work/shared.
TRACES = next((d for d in (Path(__file__).resolve().parents[2] / "shared" / "traces", Path("/work/shared/traces")) if d.is_dir()),
              Path("/work/shared/traces"))
POLICIES = ("lru", "arc", "lfu", "s3fifo", "cost")
BS, VOCAB = 16, 512  # the tiny checkpoint's vocabulary
MAX_NUM_BATCHED_TOKENS, MAX_MODEL_LEN = 2048, 4096  # the scheduler's defaults, passed to both sides
KV_BYTES_PER_BLOCK = BS * 2 * 4 * 2 * 32 * 4  # K and V x 4 layers x 2 KV heads x 32 dims x float32
# (trace, requests of its head, --max-input-len, pool sizes in blocks): each pool smaller
# than the slice's distinct blocks, so every run evicts. NOTE: one request at a time, the
# conversation head's only reuse is the system block every request starts with, which no
# policy evicts: its policies differ in nothing; the synthetic head's do.
SLICES = (("conversation", 80, 1024, (128, 512, 1536)), ("synthetic", 150, 512, (80, 320, 640)))


@dataclass
class Counters:
    queries: int
    hits: int
    evictions: int


def records(trace: str, n: int) -> list[MooncakeRecord]:
    """The trace's first n records, one output token each, one second apart (one at a time)."""
    head = load_mooncake_trace(TRACES / f"{trace}_trace.jsonl")[:n]
    return [replace(r, timestamp=1000.0 * i, output_length=1) for i, r in enumerate(head)]


def prompts(recs: list[MooncakeRecord], max_input_len: int) -> list[list[int]]:
    return [expand_hash_ids(r.hash_ids, min(r.input_length, max_input_len), VOCAB).tolist() for r in recs]


def simulated(recs: list[MooncakeRecord], max_input_len: int, num_blocks: int, policy: str) -> Counters:
    cfg = SimConfig(num_blocks, BS, max_num_seqs=1, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, max_model_len=MAX_MODEL_LEN,
                    eviction_policy=policy)
    r = simulate(TraceWorkload(recs, vocab_size=VOCAB, max_input_len=max_input_len), cfg)
    assert r.num_finished == len(recs)
    return Counters(r.prefix_cache_queries, r.prefix_cache_hits, r.num_evictions)


def _free_ports(n: int) -> list[int]:
    from frontend.serve.launcher import free_ports

    return free_ports(n)


class _Service:
    """A scheduler and a worker of the tiny checkpoint, as processes; stopped on exit."""

    def __init__(self, num_blocks: int, policy: str):
        port, worker_port, self.http_port = _free_ports(3)
        py, quiet = sys.executable, {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
        kv_mib = -(-(num_blocks + 1) * KV_BYTES_PER_BLOCK // 2**20)
        self.procs = [
            subprocess.Popen([py, "-m", "scheduler", "--port", str(port), "--worker-port", str(worker_port),
                              "--http-port", str(self.http_port), "--log-level", "WARNING", "--block-size", str(BS),
                              "--num-gpu-blocks-override", str(num_blocks), "--max-num-seqs", "1",
                              "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS), "--max-model-len", str(MAX_MODEL_LEN),
                              "--kv-eviction-policy", policy], **quiet),
            subprocess.Popen([py, "-m", "worker", "--scheduler", f"tcp://127.0.0.1:{worker_port}", "--device", "cpu",
                              "--dtype", "float32", "--block-size", str(BS), "--kv-cache-memory", f"{kv_mib}MiB",
                              "--http-port", "0", "--log-level", "WARNING"], **quiet),
        ]
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.codec: Codec = Codec(ClientResponse)

    def __enter__(self) -> _Service:
        try:
            self._wait_ready()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wait_ready(self, timeout: float = 120.0) -> None:
        wait_healthy(f"http://127.0.0.1:{self.http_port}", self.procs, "the retention_live bench's scheduler/worker", timeout)

    def generate(self, request_id: str, prompt: list[int], timeout: float = 120.0) -> None:
        """Send one request and wait for its end."""
        self.sock.send(self.codec.encode(Generate(request_id, prompt, max_tokens=1, ignore_eos=True)))
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000)):
                raise TimeoutError(f"request {request_id} unfinished after {timeout} s")
            msg = self.codec.decode(self.sock.recv())
            if isinstance(msg, RequestError):
                raise RuntimeError(f"request {request_id} failed: {msg.message}")
            if isinstance(msg, EngineCoreOutputs) and any(o.request_id == request_id and o.finished for o in msg.outputs):
                return

    def counters(self, queries: int, timeout: float = 10.0) -> Counters:
        """The counters once queries reach `queries` (the metrics update between steps), or at the bound."""
        deadline = time.monotonic() + timeout
        while True:
            body = urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/metrics", timeout=5).read().decode()
            # NOTE: one engine, so one sample per counter: its labels are dropped.
            values = {line.split("{")[0].split(" ")[0]: float(line.rsplit(" ", 1)[1]) for line in body.splitlines() if line and line[0] != "#"}
            got = Counters(*(int(values.get(name, -1)) for name in
                             ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "kvpool_evictions_total")))
            if got.queries == queries or time.monotonic() > deadline:
                return got
            time.sleep(0.2)

    def __exit__(self, *exc) -> None:
        self.sock.close(linger=0)
        self.ctx.term()
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)


def live(recs: list[MooncakeRecord], max_input_len: int, num_blocks: int, policy: str, expected_queries: int) -> Counters:
    with _Service(num_blocks, policy) as service:
        for i, prompt in enumerate(prompts(recs, max_input_len)):
            service.generate(f"r{i}", prompt)
        return service.counters(expected_queries)


def table() -> list[tuple[str, int, str, Counters, Counters]]:
    out = []
    for trace, n, max_input_len, capacities in SLICES:
        recs = records(trace, n)
        for num_blocks in capacities:
            for policy in POLICIES:
                sim = simulated(recs, max_input_len, num_blocks, policy)
                out.append((trace, num_blocks, policy, live(recs, max_input_len, num_blocks, policy, sim.queries), sim))
    return out


def rows() -> list[Row]:
    result = []
    for trace, num_blocks, policy, got, sim in table():
        equal = got == sim
        name = (f"retention live=sim: {trace} trace, {num_blocks} blocks, {policy}: "
                f"queries {got.queries}/{sim.queries} hits {got.hits}/{sim.hits} evictions {got.evictions}/{sim.evictions} (live/sim)")
        result.append(Row(name, 100.0 * got.hits / max(got.queries, 1), "% hit", "live = sim", equal))
    return result


def main() -> None:
    t0 = time.monotonic()
    print("| trace | blocks | policy | queries live | sim | hits live | sim | evictions live | sim | hit rate | equal |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for trace, num_blocks, policy, got, sim in table():
        print(f"| {trace} | {num_blocks} | {policy} | {got.queries} | {sim.queries} | {got.hits} | {sim.hits} | {got.evictions} | "
              f"{sim.evictions} | {100.0 * got.hits / max(got.queries, 1):.1f} % | {'equal' if got == sim else 'DIFFERS'} |", flush=True)
    print(f"\n{time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
