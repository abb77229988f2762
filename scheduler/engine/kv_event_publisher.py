"""KVEventPublisher: the pool's prefix-cache changes as vLLM KV events over ZMQ PUB.

One batch per `publish()` call (the step loop calls it once a step with what the
`KVEventRecorder` collected), sequence numbers consecutive from 0, in vLLM's wire
format (see protocol/kv_events.py), so a router built for vLLM reads it unchanged.

* PUB: the caller's thread sends without blocking (a PUB socket drops, never
  blocks, when a subscriber is slow), so `publish()` is safe on the asyncio loop.
* Replay (optional ROUTER): a daemon thread with its own socket answers a start
  sequence number with every buffered batch from there on, then vLLM's end
  marker. The buffer keeps the last ``buffer_steps`` batches.

Where the PUB socket goes (``endpoint_mode``):

* ``"bind"`` (kvpool's --kv-events-endpoint): it always binds; subscribers connect.
* ``"vllm"`` (vLLM's --kv-events-config, its ZmqEventPublisher's rule): it binds a
  wildcard (``*``, ``::``), ipc:// or inproc:// endpoint and connects to any other, so
  a subscriber that binds (a router's SUB) receives from every replica.

The replay ROUTER always binds. Every endpoint bound must be loopback tcp, ipc:// or
inproc:// unless CURVE is on (``curve_secret_key``): then both sockets are CURVE
servers and the ZAP authenticator already running on the caller's context (the
scheduler's) decides which subscribers may connect. Connecting exposes no port, so a
connected endpoint may be any tcp host.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import msgspec
import zmq

from protocol import kv_events as wire
from protocol.curve import apply_server
from scheduler.core import kv_events
from scheduler.engine.kv_event_endpoints import (
    ENDPOINT_MODES,
    check_connect_endpoint,
    check_local_endpoint,
    is_bind_endpoint,
)

REPLAY_POLL_MS = 100
def to_wire_event(event: kv_events.KVCacheEvent, int_block_hashes: bool = True) -> wire.KVCacheEvent:
    """Our event as vLLM's, filled in as vLLM's own BlockPool and KVCacheManager fill it
    for a request without LoRA: its KV-cache group's index, kind and sliding window (one
    full-attention group: 0, "full_attention", None). Hashes as 64-bit ints
    (vLLM 0.33's default), or the bytes with ``int_block_hashes=False``.

    Host-tier events (medium "CPU") as vLLM's offloading connector sends them: no
    parent, no tokens, no group fields."""
    h = wire.int_block_hash if int_block_hashes else bytes
    match event:
        case kv_events.BlockStored() if event.medium != kv_events.MEDIUM_GPU:
            return wire.BlockStored(
                block_hashes=[h(x) for x in event.block_hashes], parent_block_hash=None, token_ids=[],
                block_size=event.block_size, lora_id=None, medium=event.medium, lora_name=None,
            )
        case kv_events.BlockRemoved() if event.medium != kv_events.MEDIUM_GPU:
            return wire.BlockRemoved(block_hashes=[h(x) for x in event.block_hashes], medium=event.medium)
        case kv_events.BlockStored():
            parent = event.parent_block_hash
            return wire.BlockStored(
                block_hashes=[h(x) for x in event.block_hashes],
                parent_block_hash=None if parent is None else h(parent),
                token_ids=list(event.token_ids or ()),
                block_size=event.block_size,
                lora_id=None,
                medium=event.medium,
                lora_name=None,
                group_idx=event.group_idx,
                kv_cache_spec_kind=wire.KV_CACHE_SPEC_KIND_SLIDING_WINDOW if event.sliding_window else wire.KV_CACHE_SPEC_KIND_FULL_ATTENTION,
                kv_cache_spec_sliding_window=event.sliding_window or None,
            )
        case kv_events.BlockRemoved():
            return wire.BlockRemoved(block_hashes=[h(x) for x in event.block_hashes], medium=event.medium, group_idx=event.group_idx)
        case kv_events.AllBlocksCleared():
            return wire.AllBlocksCleared()
    raise TypeError(f"not a KV cache event: {event!r}")


def _check_arguments(
    ctx: zmq.Context | None, endpoint: str, replay_endpoint: str | None, buffer_steps: int, data_parallel_rank: int, curve: bool,
    endpoint_mode: str = "bind",
) -> None:
    """ValueError for a publisher that must not be built (see the module docstring)."""
    if curve and ctx is None:
        raise ValueError("CURVE needs the caller's context, where its ZAP authenticator runs")
    if endpoint_mode not in ENDPOINT_MODES:
        raise ValueError(f"endpoint_mode must be one of {', '.join(ENDPOINT_MODES)}, got {endpoint_mode!r}")
    if is_bind_endpoint(endpoint, endpoint_mode):
        check_local_endpoint(endpoint, "--kv-events-endpoint", allow_remote=curve)
    else:
        check_connect_endpoint(endpoint, "--kv-events-endpoint")
    if replay_endpoint is not None:
        check_local_endpoint(replay_endpoint, "--kv-events-replay-endpoint", allow_remote=curve)
    if buffer_steps < 1:
        raise ValueError(f"buffer_steps must be positive, got {buffer_steps}")
    if data_parallel_rank < 0:
        raise ValueError(f"data_parallel_rank must be non-negative, got {data_parallel_rank}")


def _bind(sock: zmq.Socket, endpoint: str, curve_secret_key: str | None, hwm: int, linger: int, connect: bool = False) -> str:
    """Bind ``sock`` (a CURVE server with a key), or connect it; the endpoint it got
    (a wildcard port resolved when bound)."""
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.LINGER, linger)
    if connect:
        sock.connect(endpoint)
        return endpoint
    if curve_secret_key is not None:
        apply_server(sock, curve_secret_key)
    sock.bind(endpoint)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


class KVEventPublisher:
    def __init__(
        self,
        ctx: zmq.Context | None,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        *,
        hwm: int = 100_000,
        int_block_hashes: bool = True,
        data_parallel_rank: int = 0,
        curve_secret_key: str | None = None,
        endpoint_mode: str = "bind",
    ):
        curve = curve_secret_key is not None
        _check_arguments(ctx, endpoint, replay_endpoint, buffer_steps, data_parallel_rank, curve, endpoint_mode)
        self.topic = topic.encode("utf-8")
        self.int_block_hashes = int_block_hashes
        self.data_parallel_rank = data_parallel_rank
        # NOTE: a shadow gives plain (blocking-API) sockets even on a zmq.asyncio
        # Context; only a context made here is terminated by close().
        self._own_ctx = ctx is None
        self._ctx = zmq.Context() if ctx is None else zmq.Context.shadow(ctx.underlying)
        self._encoder = msgspec.msgpack.Encoder()
        # Next sequence number; batches are numbered consecutively from 0.
        self.next_seq = 0
        # (seq, payload) of the last buffer_steps batches, for replay.
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._closed = False
        self._replay: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        self.replay_endpoint: str | None = None
        self._pub = self._ctx.socket(zmq.PUB)
        try:
            connect = not is_bind_endpoint(endpoint, endpoint_mode)
            self.endpoint = _bind(self._pub, endpoint, curve_secret_key, hwm, linger=500, connect=connect)
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                # vLLM's sizing: a whole replay plus its end marker always fits.
                self.replay_endpoint = _bind(self._replay, replay_endpoint, curve_secret_key, 2 * (buffer_steps + 1), linger=0)
        except BaseException:
            self._close_after_failed_bind()
            raise
        if self._replay is not None:
            # NOTE: from here on only the thread touches the replay socket.
            self._thread = threading.Thread(target=self._serve_replay, name="kv-events-replay", daemon=True)
            self._thread.start()

    def _close_after_failed_bind(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        if self._own_ctx:
            self._ctx.term()

    @property
    def last_seq(self) -> int:
        """Sequence number of the last batch published; -1 before the first."""
        return self.next_seq - 1

    def publish(self, events: list[kv_events.KVCacheEvent]) -> None:
        """Send ``events`` as one batch (nothing for an empty list). Never blocks."""
        if not events:
            return
        if self._closed:
            raise RuntimeError("KVEventPublisher is closed")
        batch = wire.KVEventBatch(
            ts=time.time(),
            events=[to_wire_event(e, self.int_block_hashes) for e in events],
            data_parallel_rank=self.data_parallel_rank,
        )
        payload = self._encoder.encode(batch)
        seq = self.next_seq
        self.next_seq += 1
        with self._lock:
            self._buffer.append((seq, payload))
        try:
            self._pub.send_multipart([self.topic, wire.encode_seq(seq), payload], flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # a subscriber past the high-water mark misses it; replay has it

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * REPLAY_POLL_MS / 1000)
        self._pub.close()
        if self._own_ctx:
            self._ctx.term()

    # --- replay (its own thread) ------------------------------------------------------

    def _serve_replay(self) -> None:
        sock = self._replay
        try:
            while not self._stopping.is_set():
                if sock.poll(REPLAY_POLL_MS):
                    self._answer_replay(sock, sock.recv_multipart())
        except zmq.ZMQError:
            if not self._stopping.is_set():
                raise
        finally:
            sock.close(linger=0)

    def _answer_replay(self, sock: zmq.Socket, frames: list[bytes]) -> None:
        # [identity, b"", start seq]: a DEALER sending [b"", seq], or a REQ.
        if len(frames) != 3 or len(frames[2]) != wire.SEQ_BYTES:
            return
        client_id, _, start = frames
        start_seq = int.from_bytes(start, "big")
        with self._lock:
            buffered = list(self._buffer)
        for seq, payload in buffered:
            if seq >= start_seq:
                sock.send_multipart([client_id, b"", self.topic, wire.encode_seq(seq), payload])
        sock.send_multipart([client_id, b"", b"", wire.encode_seq(wire.REPLAY_END_SEQ), b""])


def make_kv_event_sink(
    ctx: zmq.Context | None,
    endpoint: str | None,
    replay_endpoint: str | None = None,
    topic: str = "",
    buffer_steps: int = 10_000,
    curve_secret_key: str | None = None,
    int_block_hashes: bool = True,
    data_parallel_rank: int = 0,
    endpoint_mode: str = "bind",
    hwm: int = 100_000,
) -> tuple[kv_events.KVEventRecorder | None, KVEventPublisher | None]:
    """(the pool's event_sink, the publisher), or (None, None) without an endpoint.

    ``data_parallel_rank`` goes into every batch and ``topic`` into every frame, so
    an indexer subscribed to several replicas tells them apart.

    The step loop calls ``publisher.publish(recorder.take_events())`` after each step and
    after anything else that changes the cache (a reset, a lost worker)."""
    if endpoint is None:
        if replay_endpoint is not None:
            raise ValueError("--kv-events-replay-endpoint needs --kv-events-endpoint")
        return None, None
    publisher = KVEventPublisher(
        ctx, endpoint, replay_endpoint, topic, buffer_steps, curve_secret_key=curve_secret_key, int_block_hashes=int_block_hashes,
        data_parallel_rank=data_parallel_rank, endpoint_mode=endpoint_mode, hwm=hwm,
    )
    return kv_events.KVEventRecorder(), publisher
