"""A worker SIGKILLed under load loses no request: requests in flight resume on the
restarted worker, and those arriving meanwhile wait in the scheduler's queue instead
of getting a 503. The load is the issue's repro: `python -m loadgen --backend openai
--request-rate 40 --num-requests 200` through `kvpool serve`, the worker (or, with
two tensor-parallel ranks, rank 1) killed once the load is running. Real processes,
real sockets; every process is stopped by the fixtures."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from kvtest.openai_load import openai_load
from kvtest.procs import children
from kvtest.serve import kvpool_serve
from kvtest.tp_ranks import rank_pids

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _victim(serve_pid: int, tp: int) -> int:
    (worker,) = [p for p, cmd in children(serve_pid).items() if "-m worker " in cmd]
    if tp == 1:
        return worker
    return rank_pids(worker)[1]


@pytest.mark.parametrize("tp", [1, 2], ids=["one-worker", "tp2-rank1"])
def test_a_killed_worker_under_load_costs_no_request(tiny_checkpoint, tmp_path, tp):
    with kvpool_serve(tiny_checkpoint, tmp_path / "logs", "--tensor-parallel-size", str(tp), "--dtype", "float32") as s:
        result = tmp_path / "r.json"
        lg = openai_load(s.base_url, result)
        try:
            time.sleep(1.5)  # the load is running: some requests in flight, most still to come
            victim = _victim(s.proc.pid, tp)
            os.kill(victim, signal.SIGKILL)
            out, _ = lg.communicate(timeout=240)
        finally:
            if lg.poll() is None:
                lg.kill()
                lg.wait(10)
        assert lg.returncode == 0, out + s.logs()
        r = json.loads(result.read_text())
        assert (r["completed"], r["failed"]) == (200, 0), out
        # It was a real restart: kvpool serve said so.
        said = "".join(s.output)
        assert "the worker exited" in said and "restarting it" in said, said
