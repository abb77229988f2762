"""Replicas behind vllm-router (``python -m bench router``): two ``kvpool serve`` of the
tiny checkpoint (CPU) behind ``vllm-router --policy cache_aware``, closed-loop load
through the router, one replica SIGKILLed (every process of it) mid-run.

Counted, for streamed and for non-streamed requests (a fresh pair of replicas each):

* requests that failed (an HTTP error, a cut stream, a refused connection) among those
  in flight at the kill, and among those sent after it (target: 0 -- the router retries
  a failed attempt on the other replica and its circuit breaker takes the dead one out);
* requests the survivor served after the kill (context), and that both served before.

The router runs with the recipe's health checking (deploy/README.md): every 2 s, out
after 2 failures. Also used by tests/e2e/test_router.py: `Replica` (one ``kvpool
serve`` in its own process group, so a kill takes all of it) and `Router`.
"""

from __future__ import annotations

import http.client
import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from bench.table import Row

ROUTER_HEALTH_ARGS = ["--health-check-interval-secs", "2", "--health-failure-threshold", "2", "--worker-startup-check-interval", "1"]
CLIENTS, PROMPT, MAX_TOKENS = 8, "The scheduler owns every block of KV memory as a number.", 24
BEFORE_S, AFTER_S = 4.0, 8.0


def free_port() -> int:
    from frontend.serve.launcher import free_ports

    return free_ports(1)[0]


def router_binary() -> str | None:
    """vllm-router beside this interpreter (the venv's, from the test extra), else on PATH."""
    beside = Path(sys.executable).with_name("vllm-router")
    return str(beside) if beside.exists() else shutil.which("vllm-router")


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return 0, b""

def shared_prefix_prompts(num_prefixes: int, repeats: int, seed: int = 7) -> list[str]:
    """The router workloads' prompts: ``num_prefixes`` long shared prefixes (100 words,
    several blocks each), each asked ``repeats`` times with its own short suffix, shuffled."""
    rng = random.Random(seed)
    words = ["block", "cache", "prefix", "hash", "token", "pool", "evict", "worker", "scheduler", "router", "replica"]
    prefixes = [" ".join(rng.choice(words) for _ in range(100)) for _ in range(num_prefixes)]
    prompts = [f"{p} {i}-{j}" for i, p in enumerate(prefixes) for j in range(repeats)]
    rng.shuffle(prompts)
    return prompts


def metric_totals(url: str, *names: str) -> tuple[float, ...]:
    """Each named sample of one replica's /metrics, summed over its labels."""
    status, text = http_get(url + "/metrics")
    if status != 200:
        raise RuntimeError(f"{url}/metrics answered {status}")
    totals = dict.fromkeys(names, 0.0)
    for line in text.decode().splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return tuple(totals.values())


def prefix_cache_totals(url: str) -> tuple[float, float]:
    """(hits, queries) from one replica's /metrics."""
    hits, queries = metric_totals(url, "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
    return hits, queries


def aggregate_hit_rate(before: list[tuple[float, float]], after: list[tuple[float, float]]) -> float:
    """Hits over queries summed over the replicas between two `prefix_cache_totals` each;
    0.0 when nothing was looked up."""
    hits = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    queries = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    return hits / queries if queries else 0.0



def _stop(proc: subprocess.Popen, timeout: float) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


class Replica:
    """One ``kvpool serve`` on a free loopback port, in its own session; with
    ``kv_events``, publishing its KV events on another (``kv_events_endpoint``)."""

    def __init__(self, model: Path | str, log_dir: Path, *extra: str, kv_events: bool = False):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.kv_events_endpoint = f"tcp://127.0.0.1:{free_port()}" if kv_events else None
        if self.kv_events_endpoint is not None:
            extra = (*extra, "--kv-events-endpoint", self.kv_events_endpoint)
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        kvpool = str(Path(sys.executable).with_name("kvpool"))
        argv = [kvpool, "serve", str(model), "--port", str(self.port), "--log-dir", str(self.log_dir), "--device", "cpu",
                "--kv-cache-memory", "8MiB", "--stop-timeout", "5", *extra]
        self._log = open(self.log_dir / "serve.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while http_get(self.url + "/health", 2)[0] != 200:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvpool serve exited with {self.proc.returncode}:\n{self.logs()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"kvpool serve on {self.url} not healthy within {timeout:g} s:\n{self.logs()}")
            time.sleep(0.2)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in sorted(self.log_dir.glob("*.log")))

    def kill(self) -> None:
        """SIGKILL every process of this replica at once (a crashed host, not a shutdown)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)

    def stop(self) -> None:
        _stop(self.proc, 20)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # anything the launcher left behind
        except ProcessLookupError:
            pass
        self._log.close()


def kv_aware_args(replicas: list[Replica], block_size: int, model: str) -> list[str]:
    """vllm-router's flags that point ``kv_aware`` at each replica's KV events.

    NOTE: vllm-router 0.1.17 subscribes to an HTTP worker's events only from these static
    flags: it reads /kv_event_sources and /get_server_info (kvpool answers both as vLLM)
    but spawns no subscriber for an HTTP worker from them (docs/architecture.md, "KV-aware
    routing")."""
    args = []
    for r in replicas:
        if r.kv_events_endpoint is None:
            raise ValueError(f"replica {r.url} publishes no KV events (Replica(..., kv_events=True))")
        args += ["--kv-event-source", f"{r.url}={r.kv_events_endpoint}"]
    return args + ["--kv-event-block-size", str(block_size), "--kv-event-model", model]


class Router:
    """``vllm-router`` over ``worker_urls`` on a free loopback port (metrics on another)."""

    def __init__(self, worker_urls: list[str], policy: str, log_path: Path, *extra: str, log_level: str = "warning"):
        binary = router_binary()
        if binary is None:
            raise FileNotFoundError("vllm-router not found (pip install vllm-router, or `make install`: the test extra has it)")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        # NOTE: no worker URLs: a PD-mode router (bench/pd_fleet.py) names its engines in ``extra``.
        urls = ["--worker-urls", *worker_urls] if worker_urls else []
        argv = [binary, *urls, "--policy", policy, "--host", "127.0.0.1", "--port", str(self.port),
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), "--log-level", log_level, *extra]
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while http_get(self.url + "/readiness", 2)[0] != 200:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm-router exited with {self.proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"vllm-router not ready within {timeout:g} s:\n{self.log_tail()}")
            time.sleep(0.2)

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        _stop(self.proc, 10)
        self._log.close()


def complete(base_url: str, body: dict, timeout: float = 60.0) -> tuple[bool, str]:
    """POST /v1/completions; (True, "") when it fully succeeded -- for a stream, when
    it ended with [DONE] -- else (False, why)."""
    req = urllib.request.Request(base_url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            data = r.read()
    except urllib.error.HTTPError as e:
        return False, f"HTTP {e.code}: {e.read()[:200]!r}"
    except (OSError, http.client.HTTPException) as e:  # refused, reset, cut mid-body (IncompleteRead)
        return False, f"{type(e).__name__}: {e}"
    if body.get("stream"):
        return (True, "") if data.rstrip().endswith(b"data: [DONE]") else (False, f"stream ended without [DONE]: {data[-200:]!r}")
    try:
        ok = len(json.loads(data)["choices"]) == 1
    except (ValueError, KeyError):
        ok = False
    return (True, "") if ok else (False, f"not a completion: {data[:200]!r}")


@dataclass
class Outcome:
    start: float
    end: float
    ok: bool
    why: str


def closed_loop(base_url: str, body: dict, clients: int, stop: threading.Event) -> list[Outcome]:
    """``clients`` threads, each sending a request again as soon as its last one ended,
    until ``stop``; request n's prompt starts with n, so no two share a prefix and
    cache_aware spreads them over the replicas."""
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    counter = itertools.count()

    def client():
        while not stop.is_set():
            t0 = time.monotonic()
            ok, why = complete(base_url, {**body, "prompt": f"{next(counter)}: {body['prompt']}"})
            with lock:
                outcomes.append(Outcome(t0, time.monotonic(), ok, why))

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    stop.wait()
    for t in threads:
        t.join(120)
    return outcomes


def requests_served(replica_url: str) -> float:
    """vllm:request_success_total summed over finish reasons (0 when unreachable)."""
    status, text = http_get(replica_url + "/metrics")
    if status != 200:
        return 0.0
    total = 0.0
    for line in text.decode().splitlines():
        if line.startswith("vllm:request_success_total"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def kill_one_under_load(model, work: Path, stream: bool) -> dict:
    """Two replicas, the router, load; SIGKILL replica 0 after BEFORE_S; figures."""
    replicas = [Replica(model, work / f"replica{i}") for i in range(2)]
    router = None
    try:
        for r in replicas:
            r.wait_ready()
        router = Router([r.url for r in replicas], "cache_aware", work / "router.log", *ROUTER_HEALTH_ARGS)
        router.wait_ready()
        body = {"model": str(model), "prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": stream}
        stop = threading.Event()
        result: list[list[Outcome]] = []
        loader = threading.Thread(target=lambda: result.append(closed_loop(router.url, body, CLIENTS, stop)))
        loader.start()
        time.sleep(BEFORE_S)
        served_before = [requests_served(r.url) for r in replicas]
        survivor_before = served_before[1]
        t_kill = time.monotonic()
        replicas[0].kill()
        time.sleep(AFTER_S)
        stop.set()
        loader.join(180)
        survivor_after = requests_served(replicas[1].url)
    finally:
        if router is not None:
            router.stop()
        for r in replicas:
            r.stop()
    outcomes = result[0]
    in_flight = [o for o in outcomes if o.start < t_kill < o.end]
    after = [o for o in outcomes if o.start >= t_kill]
    return {
        "served_before": served_before,
        "in_flight": len(in_flight), "in_flight_failed": sum(not o.ok for o in in_flight),
        "after": len(after), "after_failed": sum(not o.ok for o in after),
        "before_failed": sum(not o.ok for o in outcomes if o.end <= t_kill),
        "survivor_served_after": survivor_after - survivor_before,
        "why": sorted({o.why for o in outcomes if not o.ok})[:5],
    }


def rows() -> list[Row]:
    import tempfile

    from worker.tiny.generate import default_checkpoint

    if router_binary() is None:
        # NOTE: a row, not nothing: the table says the suite did not run.
        return [Row("router: NOT RUN, vllm-router not found (`make install` installs it)", float("nan"), "", "", None)]
    out = []
    with tempfile.TemporaryDirectory(prefix="kvpool-router-bench-") as tmp:
        for stream in (True, False):
            kind = "streamed" if stream else "non-streamed"
            f = kill_one_under_load(default_checkpoint(), Path(tmp) / kind, stream)
            if f["why"]:
                print(f"router bench, {kind}: failures: {f['why']}", file=sys.stderr)
            both = min(f["served_before"]) > 0
            out += [
                Row(f"router, {kind}: failed before the kill (both replicas serving: {both})", f["before_failed"], "req", "0",
                    f["before_failed"] == 0 and both),
                Row(f"router, {kind}: failed of {f['in_flight']} in flight at the SIGKILL of 1 of 2", f["in_flight_failed"], "req"),
                Row(f"router, {kind}: failed of {f['after']} sent after the kill", f["after_failed"], "req", "0", f["after_failed"] == 0),
                Row(f"router, {kind}: served by the survivor after the kill", f["survivor_served_after"], "req"),
            ]
    return out


if __name__ == "__main__":
    from bench.table import print_table

    print_table(rows())
