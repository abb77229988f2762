"""The side channel's addresses: a ``host:port`` as WorkerHello and KVTransferOps carry it,
as the ZMQ endpoint a socket binds or connects, and the frames' codec (protocol/kv_pull_wire.py)."""

from __future__ import annotations

import msgspec
import zmq

from protocol.kv_pull_wire import PullReply, PullRequest
from protocol.tcp_address import split_address

ENCODER = msgspec.msgpack.Encoder()
REQUEST_DECODER = msgspec.msgpack.Decoder(PullRequest)
REPLY_DECODER = msgspec.msgpack.Decoder(PullReply)


def host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def tcp_endpoint(address: str) -> str:
    """The ZMQ endpoint of ``host:port`` (ValueError naming it when it is not one)."""
    host, port = split_address(address, "KV transfer address")
    return f"tcp://{host_port(host, port)}"


def socket_for(ctx: zmq.Context, kind: int, endpoint: str) -> zmq.Socket:
    """A socket of ``kind`` that closes at once, and speaks IPv6 when ``endpoint`` (from
    `tcp_endpoint`) has an IPv6 host."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if "[" in endpoint:
        sock.setsockopt(zmq.IPV6, 1)
    return sock
