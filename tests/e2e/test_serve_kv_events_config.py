"""`kvpool serve --kv-events-config` as a vLLM operator writes it: the scheduler
connects its PUB socket to a subscriber that binds (a router's), as vLLM does for a
plain tcp endpoint, and the events of a completion arrive there."""

from __future__ import annotations

import json
import time

import msgspec
import pytest
import zmq
from kvtest.http_api import complete_two_tokens
from kvtest.ports import free_port
from kvtest.serve import kvpool_serve

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_the_scheduler_connects_to_a_binding_subscriber_and_publishes_there(tiny_checkpoint, tmp_path):
    port = free_port()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
        sub.bind(f"tcp://127.0.0.1:{port}")
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}", "topic": "kv-events"}
        with kvpool_serve(tiny_checkpoint, tmp_path / "logs", "--kv-events-config", json.dumps(config), "--data-parallel-rank", "0") as s:
            model = str(tiny_checkpoint)
            deadline, attempt, stored = time.monotonic() + 60, 0, []
            # NOTE: the PUB connects after the SUB bound, but a batch published before the
            # connection completes is lost: a fresh prompt (two full blocks) each second.
            while not stored and time.monotonic() < deadline:
                attempt += 1
                complete_two_tokens(s.base_url, model, [5, attempt] * 20)
                end = time.monotonic() + 1.0
                while time.monotonic() < end and not stored:
                    if sub.poll(100):
                        topic, seq, payload = sub.recv_multipart()
                        events = msgspec.msgpack.decode(payload)[1]
                        assert topic == b"kv-events" and len(seq) == 8
                        stored = [e for e in events if e["type"] == "BlockStored"]
            assert stored, s.logs()
    finally:
        sub.close()
        ctx.term()
