"""A client that goes away has its requests aborted and their blocks freed, and
neither it nor a client that stops reading holds up anyone else.

Real scheduler and CPU worker over loopback. The long requests would run for
tens of seconds if they were not aborted (2,000 tokens each); every wait is bounded.
"""

from __future__ import annotations

import random
import time

import pytest
import zmq
from kvtest.cluster import Cluster, Result
from kvtest.replies import Replies

from protocol.client_messages import ClientResponse, Generate, RequestError, TokenOutput
from protocol.codec import Codec

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

ARGS = ["--max-model-len", "4096", "--max-num-seqs", "4"]
LONG = 2000
codec: Codec = Codec(ClientResponse)


def prompt(seed: int, n: int = 40) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 500) for _ in range(n)]


def collect(replies: Replies, ids: set[str], timeout: float) -> dict[str, Result]:
    results = {rid: Result(rid) for rid in ids}
    pending = set(ids)
    deadline = time.monotonic() + timeout
    while pending:
        msg = replies.recv(max(deadline - time.monotonic(), 0.001))
        match msg:
            case TokenOutput():
                results[msg.request_id].token_ids.extend(msg.new_token_ids)
                if msg.finished:
                    results[msg.request_id].finish_reason = msg.finish_reason
                    pending.discard(msg.request_id)
            case RequestError():
                raise AssertionError(f"error for {msg.request_id}: {msg.message}")
    return results


def wait_drained(c: Cluster, timeout: float = 10.0) -> dict[str, float]:
    """Poll /metrics until nothing runs, waits or holds a block."""
    deadline = time.monotonic() + timeout
    while True:
        m = c.metrics()
        if m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0 and m["vllm:kv_cache_usage_perc"] == 0:
            return m
        assert time.monotonic() < deadline, f"not drained within {timeout} s: {m}"
        time.sleep(0.1)


def wait_for(c: Cluster, running: int, waiting: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        m = c.metrics()
        if (m["vllm:num_requests_running"], m["vllm:num_requests_waiting"]) == (running, waiting):
            return
        assert time.monotonic() < deadline, f"never {running} running / {waiting} waiting: {m}"
        time.sleep(0.05)


def test_a_closed_client_has_its_running_and_waiting_requests_aborted(tmp_path):
    with Cluster(ARGS, log_dir=tmp_path) as c:
        gone = c.client()
        # 4 run (--max-num-seqs 4), 2 wait.
        for i in range(6):
            gone.send(codec.encode(Generate(f"gone-{i}", prompt(i), LONG, ignore_eos=True)))
        gone_replies = Replies(gone)
        for _ in range(2):
            assert isinstance(gone_replies.recv(30), TokenOutput)
        other = c.client()
        other.send(codec.encode(Generate("other", prompt(99), 30, ignore_eos=True)))
        wait_for(c, running=4, waiting=3)
        gone.close(linger=0)
        t0 = time.monotonic()
        m = wait_drained(c)
        drained_s = time.monotonic() - t0
        # The other client's request was admitted once the gone client's left, and ran to the end.
        result = collect(Replies(other), {"other"}, 30)["other"]
        assert result.finish_reason == "length" and len(result.token_ids) == 30
        time.sleep(0.3)
        after = c.metrics()
        assert after["vllm:generation_tokens_total"] == m["vllm:generation_tokens_total"], "tokens still produced after the drain"
        other.close(linger=0)
        assert c.health() == 200
    # Aborted, not run to the end: far fewer than 6 x 2,000 tokens were ever produced.
    assert after["vllm:generation_tokens_total"] < LONG
    assert drained_s < 10
    log = (tmp_path / "scheduler.log").read_text()
    assert "is gone: aborting its 6 requests" in log, log[-2000:]


def test_a_client_that_never_reads_does_not_stall_the_others_and_is_aborted_when_gone(tmp_path):
    with Cluster(ARGS, log_dir=tmp_path) as c:
        silent = c.client()
        silent.setsockopt(zmq.RCVHWM, 1)
        for i in range(2):
            silent.send(codec.encode(Generate(f"silent-{i}", prompt(i), LONG, ignore_eos=True)))
        wait_for(c, running=2, waiting=0)
        # Two short requests from another client run beside the silent client's and finish.
        t0 = time.monotonic()
        results = c.generate([Generate(f"reader-{i}", prompt(50 + i), 40, ignore_eos=True) for i in range(2)], timeout=30)
        served_s = time.monotonic() - t0
        assert all(r.finish_reason == "length" and len(r.token_ids) == 40 for r in results.values())
        # The silent client's requests are still running (tokens queued for it, unread).
        m = c.metrics()
        assert m["vllm:num_requests_running"] == 2
        silent.close(linger=0)
        m = wait_drained(c)
    assert m["vllm:generation_tokens_total"] < 2 * LONG
    assert served_s < 30
