"""A KV event subscriber: rebuilds a scheduler's set of cached block hashes.

`KVEventSubscriber` reads vLLM-format KV event batches (protocol/kv_events.py)
from a PUB endpoint and applies them: BlockStored adds hashes, BlockRemoved
removes them, AllBlocksCleared empties the set. Events name their medium, as
vLLM's do: the host tier's ("CPU", the offloading connector's) go to
``host_hashes``, the device pool's ("GPU", or none from older publishers) to
``cached_hashes``; the same hash may be in both. Sequence numbers must be
consecutive; a gap (a late start, a slow subscriber) is filled from the replay
endpoint before the batch that revealed it is applied. A gap older than the
publisher's replay buffer cannot be filled: it is counted in ``num_lost`` and the
set may be stale until the next AllBlocksCleared.

Run it as a tool:

    python -m loadgen.kv_events --endpoint tcp://127.0.0.1:5557 \\
        --replay-endpoint tcp://127.0.0.1:5558 [--events]

It reads vLLM's own publisher too (vLLM's current encoding, see
protocol/kv_events.py).
"""

from __future__ import annotations

import argparse
import sys
import time

import zmq

from protocol.codec import ProtocolError
from protocol.curve import apply_client
from protocol.kv_events import (
    MEDIUM_CPU,
    REPLAY_END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVEventBatch,
    batch_codec,
    decode_seq,
    encode_seq,
)


class KVEventSubscriber:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        ctx: zmq.Context | None = None,
        replay_timeout_s: float = 2.0,
        curve_secret_key: str | None = None,
        curve_server_key: str | None = None,
    ):
        """With CURVE, ``curve_secret_key`` is this subscriber's secret certificate
        and ``curve_server_key`` the publisher's (the scheduler's) public one."""
        if (curve_secret_key is None) != (curve_server_key is None):
            raise ValueError("curve_secret_key and curve_server_key go together")
        self._curve = None if curve_secret_key is None else (curve_secret_key, curve_server_key)
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.replay_timeout_s = replay_timeout_s
        self._own_ctx = ctx is None
        self._ctx = zmq.Context() if ctx is None else ctx
        self._codec = batch_codec()
        # The device pool's hashes, and the host tier's (medium "CPU").
        self.cached_hashes: set[ExternalBlockHash] = set()
        self.host_hashes: set[ExternalBlockHash] = set()
        # Sequence number of the last batch applied; -1 before the first.
        self.last_seq = -1
        self.num_batches = 0
        self.num_replays = 0
        self.num_replayed_batches = 0
        # Batches known to be missed that no replay could supply.
        self.num_lost = 0
        self._sub = self._ctx.socket(zmq.SUB)
        if self._curve is not None:
            apply_client(self._sub, *self._curve)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
        self._sub.connect(endpoint)

    def poll(self, timeout_s: float, on_batch=None) -> int:
        """Apply every batch that arrives within ``timeout_s`` (returning as soon as
        one has and none is waiting); returns how many were applied, replays included.
        ``on_batch(seq, batch)`` is called for each applied batch."""
        applied = 0
        deadline = time.monotonic() + timeout_s
        while self._sub.poll(0 if applied else max(0, int((deadline - time.monotonic()) * 1000))):
            frames = self._sub.recv_multipart()
            if len(frames) != 3:
                continue
            _, seq_frame, payload = frames
            try:
                seq = decode_seq(seq_frame)
                batch = self._codec.decode(payload)
            except (ValueError, ProtocolError):
                continue
            if seq > self.last_seq + 1:
                applied += self.replay(on_batch)  # a gap: ask for what was missed
            applied += self._apply_in_order(seq, batch, on_batch)
        return applied

    def sync(self, on_batch=None) -> int:
        """Catch up from the replay endpoint without waiting for a live batch (at
        start-up: a SUB misses whatever was published before it joined)."""
        return self.replay(on_batch)

    def replay(self, on_batch=None) -> int:
        """Ask the replay endpoint for every batch after ``last_seq`` and apply
        them; returns how many were applied (0 without a replay endpoint)."""
        if self.replay_endpoint is None:
            return 0
        self.num_replays += 1
        applied = 0
        # NOTE: a socket per replay, so a late answer to a timed-out request can
        # never be taken for the answer to the next one.
        sock = self._ctx.socket(zmq.DEALER)
        try:
            if self._curve is not None:
                apply_client(sock, *self._curve)
            sock.setsockopt(zmq.LINGER, 0)
            # NOTE: bounded, as the wait for the answer is: a peer that refused the
            # handshake (CURVE, a key it does not know) leaves no pipe, and a send
            # without one would wait for ever.
            sock.setsockopt(zmq.SNDTIMEO, max(1, int(self.replay_timeout_s * 1000)))
            sock.connect(self.replay_endpoint)
            deadline = time.monotonic() + self.replay_timeout_s
            try:
                sock.send_multipart([b"", encode_seq(self.last_seq + 1)])
            except zmq.Again:
                return 0
            while sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                frames = sock.recv_multipart()
                # vLLM 0.33.0 and kvpool: [b"", topic, seq, payload]; older vLLM: [b"", seq, payload].
                if len(frames) < 3:
                    continue
                try:
                    seq = decode_seq(frames[-2])
                    if seq == REPLAY_END_SEQ:
                        break
                    batch = self._codec.decode(frames[-1])
                except (ValueError, ProtocolError):
                    continue
                applied += self._apply_in_order(seq, batch, on_batch)
        finally:
            self.num_replayed_batches += applied
            sock.close(linger=0)
        return applied

    def _apply_in_order(self, seq: int, batch: KVEventBatch, on_batch) -> bool:
        """Apply batch ``seq`` unless it was applied already (it came live and in a
        replay); batches still missing before it are counted lost. True if applied."""
        if seq <= self.last_seq:
            return False
        if seq > self.last_seq + 1:
            # Missed, and no replay supplied them (they had left the publisher's buffer).
            self.num_lost += seq - self.last_seq - 1
        self._apply(seq, batch, on_batch)
        return True

    def _apply(self, seq: int, batch: KVEventBatch, on_batch) -> None:
        device, host = self.cached_hashes, self.host_hashes
        for event in batch.events:
            match event:
                case BlockStored(block_hashes=hashes, medium=medium):
                    (host if medium == MEDIUM_CPU else device).update(hashes)
                case BlockRemoved(block_hashes=hashes, medium=medium):
                    (host if medium == MEDIUM_CPU else device).difference_update(hashes)
                case AllBlocksCleared():
                    device.clear()
                    host.clear()
        self.last_seq = seq
        self.num_batches += 1
        if on_batch is not None:
            on_batch(seq, batch)

    def close(self) -> None:
        self._sub.close(linger=0)
        if self._own_ctx:
            self._ctx.term()


def _hex(h: ExternalBlockHash) -> str:
    return h.hex()[:16] if isinstance(h, bytes) else f"{h:016x}"


def _print_batch(seq: int, batch: KVEventBatch) -> None:
    print(f"seq {seq} ts {batch.ts:.6f} dp_rank {batch.data_parallel_rank}")
    for e in batch.events:
        match e:
            case BlockStored():
                parent = "-" if e.parent_block_hash is None else _hex(e.parent_block_hash)
                print(f"  BlockStored {len(e.block_hashes)} blocks [{', '.join(map(_hex, e.block_hashes))}] "
                      f"parent {parent} {len(e.token_ids)} tokens block_size {e.block_size} medium {e.medium}")
            case BlockRemoved():
                print(f"  BlockRemoved [{', '.join(map(_hex, e.block_hashes))}] medium {e.medium}")
            case AllBlocksCleared():
                print("  AllBlocksCleared")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadgen.kv_events", description=__doc__.split("\n\n")[0])
    p.add_argument("--endpoint", default="tcp://127.0.0.1:5557", help="the publisher's PUB endpoint (default %(default)s)")
    p.add_argument("--replay-endpoint", default=None, help="its replay ROUTER endpoint, to fill gaps (default: none, gaps stay lost)")
    p.add_argument("--topic", default="", help="topic prefix to subscribe to (default: all)")
    p.add_argument("--curve-secret-key", metavar="FILE", help="this subscriber's secret certificate (default: none, no CURVE)")
    p.add_argument("--curve-server-key", metavar="FILE", help="the scheduler's public certificate (default: none, no CURVE)")
    p.add_argument("--events", action="store_true", help="print every event, not only the count of cached hashes (default: off)")
    p.add_argument("--duration", type=float, default=None, metavar="SECONDS", help="stop after this long (default: until Ctrl-C)")
    a = p.parse_args(argv)
    if (a.curve_secret_key is None) != (a.curve_server_key is None):
        p.error("--curve-secret-key and --curve-server-key go together")
    sub = KVEventSubscriber(a.endpoint, a.replay_endpoint, a.topic, curve_secret_key=a.curve_secret_key,
                            curve_server_key=a.curve_server_key)
    on_batch = _print_batch if a.events else None
    end = None if a.duration is None else time.monotonic() + a.duration
    last_count = None
    print(f"subscribed to {a.endpoint}; waiting for the first batch of KV events", flush=True)
    try:
        sub.sync(on_batch)
        while end is None or time.monotonic() < end:
            sub.poll(0.5, on_batch)
            # NOTE: nothing to say before the first batch (last_seq is still -1, which
            # read like the replay's end marker).
            if not a.events and sub.num_batches and len(sub.cached_hashes) != last_count:
                last_count = len(sub.cached_hashes)
                print(f"seq {sub.last_seq}: {last_count} cached block hashes (lost {sub.num_lost})", flush=True)
    except KeyboardInterrupt:
        pass
    finally:
        sub.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
