"""`kvpool serve --tensor-parallel-size 2`: one rank SIGKILLed mid-stream, the launcher
restarts the whole group and the stream ends with the text of an uninterrupted run;
SIGTERM leaves no rank behind."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from pathlib import Path

import pytest
from kvtest.http_api import PROMPT, post
from kvtest.serve import kvpool_serve
from kvtest.tp_ranks import rank_pids

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def worker_pid(launcher: int) -> int | None:
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == launcher:
                if b"-m\0worker\0" in (d / "cmdline").read_bytes():
                    return int(d.name)
        except (OSError, IndexError, ValueError):
            pass
    return None


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_until(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return value


def test_a_killed_rank_restarts_the_group_and_the_stream_completes(tiny_checkpoint, tmp_path):
    body = {"prompt": PROMPT, "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    with kvpool_serve(tiny_checkpoint, tmp_path, "--tensor-parallel-size", "2", "--dtype", "float32") as s:
        assert "on each of 2 ranks" in s.ready_line
        status, out = post(s, "/v1/completions", body)
        assert status == 200
        expected = out["choices"][0]["text"]
        leader = worker_pid(s.proc.pid)
        ranks = rank_pids(leader)
        assert list(ranks) == [1]
        req = urllib.request.Request(s.base_url + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            lines = [r.readline(), r.readline()]
            os.kill(ranks[1], signal.SIGKILL)
            lines += r.read().split(b"\n")
        events = [json.loads(line[6:]) for line in lines if line.startswith(b"data: {")]
        assert all("error" not in e for e in events), events[-1]
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert "".join(e["choices"][0]["text"] for e in events) == expected
        new_leader = wait_until(lambda: (p := worker_pid(s.proc.pid)) != leader and p, 30, "a new group")
        new_ranks = wait_until(lambda: rank_pids(new_leader), 30, "the new group's rank 1")
        assert list(new_ranks) == [1] and new_ranks[1] != ranks[1]
        status, out = post(s, "/v1/completions", {**body, "max_tokens": 4})
        assert status == 200 and out["usage"]["completion_tokens"] == 4
    assert s.proc.returncode == 0
    assert not alive(new_leader) and not alive(new_ranks[1]) and not alive(ranks[1])
