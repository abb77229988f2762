"""The publisher's ``endpoint_mode="vllm"`` (vLLM's --kv-events-config): it binds a
wildcard, ipc:// or inproc:// endpoint and connects to any other, as vLLM's
ZmqEventPublisher._is_bind_endpoint decides; checked with real SUB sockets that bind
(the connect case) and that connect (the bind case)."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq
from kvtest.ports import free_port

from scheduler.core.kv_events import AllBlocksCleared
from scheduler.engine.kv_event_endpoints import is_bind_endpoint
from scheduler.engine.kv_event_publisher import KVEventPublisher


@pytest.mark.parametrize(
    ("endpoint", "binds"),
    [("tcp://*:5557", True), ("tcp://[::]:5557", True), ("tcp://[::1]:5557", True), ("ipc:///tmp/kv.sock", True),
     ("inproc://kv", True), ("tcp://127.0.0.1:5557", False), ("tcp://router.example:5557", False), ("tcp://10.0.0.5:5557", False)],
)
def test_vllms_rule(endpoint, binds):
    # the same answers as vllm/distributed/kv_events.py ZmqEventPublisher._is_bind_endpoint
    assert is_bind_endpoint(endpoint, "vllm") is binds
    assert is_bind_endpoint(endpoint, "bind") is True  # kvpool's own flag always binds


def received(pub: KVEventPublisher, sub: zmq.Socket) -> list[bytes]:
    """Publish until ``sub`` has a batch (slow joiner), bounded; its frames."""
    deadline = time.monotonic() + 10
    while not sub.poll(50):
        assert time.monotonic() < deadline, "no batch reached the subscriber within 10 s"
        pub.publish([AllBlocksCleared()])
    return sub.recv_multipart()


def test_a_plain_tcp_endpoint_is_connected_to_a_subscriber_that_binds():
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    port = free_port()
    pub = None
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.bind(f"tcp://127.0.0.1:{port}")
        pub = KVEventPublisher(None, f"tcp://127.0.0.1:{port}", topic="kv", endpoint_mode="vllm")
        assert pub.endpoint == f"tcp://127.0.0.1:{port}"
        topic, _seq, payload = received(pub, sub)
        assert topic == b"kv" and msgspec.msgpack.decode(payload)[1] == [{"type": "AllBlocksCleared"}]
    finally:
        if pub is not None:
            pub.close()
        sub.close(linger=0)
        ctx.term()


def test_the_same_endpoint_under_kvpools_flag_is_bound_and_a_binding_subscriber_collides():
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    port = free_port()
    try:
        sub.bind(f"tcp://127.0.0.1:{port}")
        with pytest.raises(zmq.ZMQError):
            KVEventPublisher(None, f"tcp://127.0.0.1:{port}")  # "bind": the port is taken
    finally:
        sub.close(linger=0)
        ctx.term()


def test_an_ipc_endpoint_is_bound_and_a_subscriber_connects(tmp_path):
    endpoint = f"ipc://{tmp_path}/kv.sock"
    ctx = zmq.Context()
    pub = KVEventPublisher(None, endpoint, topic="kv", endpoint_mode="vllm")
    sub = ctx.socket(zmq.SUB)
    try:
        assert (tmp_path / "kv.sock").exists()  # bound: the socket file is the publisher's
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(endpoint)
        topic, _seq, _payload = received(pub, sub)
        assert topic == b"kv"
    finally:
        sub.close(linger=0)
        pub.close()
        ctx.term()


def test_a_wildcard_is_bound_so_it_must_be_loopback_without_curve():
    with pytest.raises(ValueError, match="not a loopback address"):
        KVEventPublisher(None, "tcp://*:5557", endpoint_mode="vllm")


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1", "udp://10.0.0.5:5557", "router:5557"])
def test_an_endpoint_that_cannot_be_connected_to_is_named(endpoint):
    with pytest.raises(ValueError, match="expected tcp://HOST:PORT to connect to"):
        KVEventPublisher(None, endpoint, endpoint_mode="vllm")


def test_the_replay_socket_always_binds_loopback():
    with pytest.raises(ValueError, match="kv-events-replay-endpoint"):
        KVEventPublisher(None, "tcp://127.0.0.1:5557", "tcp://10.0.0.5:5558", endpoint_mode="vllm")
