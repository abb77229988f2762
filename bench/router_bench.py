"""Replicas behind vllm-router (``python -m bench router``): two ``kvpool serve`` of the
tiny checkpoint (CPU) behind ``vllm-router --policy cache_aware``, closed-loop load
through the router, one replica SIGKILLed (every process of it) mid-run.

Counted, for streamed and for non-streamed requests (a fresh pair of replicas each):

* requests that failed (an HTTP error, a cut stream, a refused connection) among those
  in flight at the kill, and among those sent after it (target: 0 -- the router retries
  a failed attempt on the other replica and its circuit breaker takes the dead one out);
* requests the survivor served after the kill (context), and that both served before.

The router runs with the recipe's health checking (deploy/README.md): every 2 s, out
after 2 failures. The processes: bench/replicas.py; the load: bench/replica_load.py.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

from bench.replica_load import Outcome, closed_loop, requests_served
from bench.replicas import ROUTER_HEALTH_ARGS, Replica, Router, router_binary
from bench.table import Row

CLIENTS, PROMPT, MAX_TOKENS = 8, "The scheduler owns every block of KV memory as a number.", 24
BEFORE_S, AFTER_S = 4.0, 8.0


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
