"""Two `kvpool serve` replicas publish KV events an indexer can tell apart: each frame
carries its `--kv-events-topic`, each batch rank 0 (vLLM's data_parallel_rank of an engine
outside a data-parallel group), read off the wire by a plain ZMQ SUB (not kvpool's own
subscriber)."""

from __future__ import annotations

import contextlib
import time

import msgspec
import pytest
import zmq
from kvtest.cluster import free_port
from kvtest.http_api import complete_two_tokens
from kvtest.serve import kvpool_serve

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_each_replica_publishes_its_own_topic_and_rank_0(tiny_checkpoint, tmp_path):
    model = str(tiny_checkpoint)
    replicas = [(0, f"kv@replica-a@{model}"), (0, f"kv@replica-b@{model}")]
    endpoints = [f"tcp://127.0.0.1:{free_port()}" for _ in replicas]
    ctx = zmq.Context()
    with contextlib.ExitStack() as stack:
        stack.callback(ctx.destroy, 0)
        served = [
            stack.enter_context(kvpool_serve(tiny_checkpoint, tmp_path / f"r{i}", "--kv-events-endpoint", ep,
                                             "--kv-events-topic", topic))
            for i, ((_rank, topic), ep) in enumerate(zip(replicas, endpoints, strict=True))
        ]
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@")  # one subscriber over both, as an indexer does
        for ep in endpoints:
            sub.connect(ep)
        seen: dict[bytes, set[int]] = {}
        deadline = time.monotonic() + 60
        attempt = 0
        # NOTE: a SUB misses what is published before it has joined: until both replicas
        # have been heard, each unheard one gets a fresh prompt (two full blocks) a second.
        while time.monotonic() < deadline and len(seen) < 2:
            attempt += 1
            for i, (s, (_, topic)) in enumerate(zip(served, replicas, strict=True)):
                if topic.encode() not in seen:
                    complete_two_tokens(s.base_url, model, [7 + i, attempt] * 20)
            end = time.monotonic() + 1.0
            while time.monotonic() < end:
                if sub.poll(100):
                    topic, seq, payload = sub.recv_multipart()
                    assert len(seq) == 8
                    batch = msgspec.msgpack.decode(payload)  # [ts, events, data_parallel_rank]
                    assert batch[1], "an empty batch was published"
                    seen.setdefault(topic, set()).add(batch[2])
        assert seen == {topic.encode(): {rank} for rank, topic in replicas}


def test_a_rank_other_than_0_is_refused(tiny_checkpoint, capsys):
    from frontend.serve.cli import main
    from scheduler.engine.args import config_from_args
    from scheduler.engine.kv_event_publisher import KVEventPublisher

    for rank in ("-1", "3"):
        assert main(["serve", str(tiny_checkpoint), "--data-parallel-rank", rank]) == 2  # refused before anything starts
        assert f"--data-parallel-rank {rank}: a kvpool serve is one engine, data-parallel size 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        config_from_args(["--data-parallel-rank", "-1"])
    assert e.value.code == 2 and "--data-parallel-rank must be non-negative, got -1" in capsys.readouterr().err
    with pytest.raises(ValueError, match="data_parallel_rank must be non-negative, got -2"):
        KVEventPublisher(None, "inproc://never", data_parallel_rank=-2)
    assert config_from_args(["--data-parallel-rank", "2"]).data_parallel_rank == 2
