"""Two `kvpool serve` on one host see each other (worker/cpu/host_peers.py): each worker
registers while it lives, a big step stays on the usual threads while the other runs,
and takes every core again once it has stopped; nothing is left behind."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
from kvtest.waiting import wait_for

from bench.replicas import Replica

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _complete(url: str, model: str, salt: str) -> None:
    """One prompt of well over 128 tokens (the tiny checkpoint's wide-step threshold),
    none of it cached: ``salt`` leads."""
    prompt = salt + " " + " ".join(f"word{i}" for i in range(200))
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 1}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200


def test_two_workers_on_one_host_keep_big_steps_narrow_until_one_stops(tiny_checkpoint, tmp_path, monkeypatch):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))  # the servers' temp dir, so the registry is this test's
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    model = str(tiny_checkpoint)
    first = Replica(model, tmp_path / "a")
    second = None
    try:
        first.wait_ready()
        registry = next(tmp.glob("kvpool-workers-*"))
        assert len(list(registry.glob("*.lock"))) == 1
        second = Replica(model, tmp_path / "b")
        second.wait_ready()
        assert len(list(registry.glob("*.lock"))) == 2

        log = tmp_path / "a" / "worker.log"
        _complete(first.url, model, "first")
        assert "another kvpool worker on this host" in log.read_text()

        second.stop()
        second = None
        wait_for(lambda: len(list(registry.glob("*.lock"))) == 1, "the stopped worker's file removed")
        time.sleep(1.1)  # the registry is read at most once a second
        _complete(first.url, model, "second")
        assert "no other kvpool worker on this host" in log.read_text()
    finally:
        if second is not None:
            second.stop()
        first.stop()
    assert list(registry.glob("*.lock")) == []
