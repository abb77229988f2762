"""KVPuller: a decode engine's worker reads a prefill engine's lent blocks into its own
(P/D disaggregation, protocol/kv_pull_wire.py), on a thread of its own.

A plan's pulls are queued (`submit`) and done one at a time, FIFO: one DEALER per
prefill worker's address sends a ``PullRequest`` and waits at most ``read_timeout``
seconds for the reply, whose payload is checked (its length, the block size) before a
byte is written into the local blocks. Each pull is reported (`take_pulled`, sent as
``KVTransferDone``) with the number of blocks written: all of them, or 0 on any failure
(refused, timed out, the wrong size), logged with why.

A pull writes into its device blocks while later steps run: safe, because the scheduler
schedules no token of those blocks and frees none of them before the pull is reported,
and nothing else holds them (the external tier's loads rest on the same contract).

NOTE: a DEALER whose read timed out is closed and made again for the next pull of that
address: a late reply (a slow or dead peer's) would otherwise be taken for the next
pull's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import msgspec
import torch
import zmq

from protocol.kv_pull_wire import PullRequest
from worker.kv.kv_block_bytes import block_bytes, write_blocks
from worker.transfer.side_channel import ENCODER, REPLY_DECODER, socket_for, tcp_endpoint

log = logging.getLogger("kvpool.worker.transfer")

# A wait for a reply is cut into slices this long, so that `close` is seen within one.
POLL_SLICE_S = 0.1


@dataclass(frozen=True, slots=True)
class Pull:
    """One pull of a plan (KVTransferOps): remote blocks of ``request_id`` at ``address`` (one
    list per KV-cache group) into ``block_ids`` (the groups' lists one after another)."""

    pull_id: int
    address: str
    request_id: str
    remote_block_ids: list[list[int]]
    block_ids: list[int]


@dataclass(slots=True)
class PullerCounters:
    """Running totals, read by the worker's metrics (worker/transfer/transfer_metrics.py)."""

    pulled_blocks: int = 0
    pulled_bytes: int = 0
    pull_seconds: float = 0.0
    # Pulls that wrote nothing, by why: a PullReply.error, timeout, size, reply or address.
    failures: dict[str, int] = field(default_factory=dict)


class PullFailed(Exception):
    """A pull wrote nothing: ``reason`` (counted) and a line for the log."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


class KVPuller:
    """Pulls into ``kv_caches`` (one per layer, (2, blocks, bs, kvh, hd)) from workers of the same ``identity``."""

    def __init__(self, kv_caches: list[torch.Tensor], identity: str, read_timeout: float):
        self.kv_caches = kv_caches
        self.identity = identity
        self.block_bytes = block_bytes(kv_caches)
        self.read_timeout = read_timeout
        self.counters = PullerCounters()
        self._ctx = zmq.Context()
        self._sockets: dict[str, zmq.Socket] = {}  # endpoint -> its DEALER, the thread's own
        self._cond = threading.Condition()
        self._queue: deque[Pull] = deque()
        self._busy = False
        self._stopping = False
        self._lock = threading.Lock()
        self._pulled: dict[int, int] = {}
        self._num_pending = 0
        self._thread = threading.Thread(target=self._run, name="kv-transfer-puller", daemon=True)
        self._thread.start()

    # --- the process loop's side -------------------------------------------------------

    def submit(self, pulls: list[Pull]) -> None:
        with self._cond:
            self._queue.extend(pulls)
            self._num_pending += len(pulls)
            self._cond.notify()

    @property
    def has_pending(self) -> bool:
        return self._num_pending > 0

    def take_pulled(self) -> dict[int, int]:
        """Pull id -> blocks written, of the pulls ended since the last call."""
        with self._lock:
            pulled, self._pulled = self._pulled, {}
        return pulled

    def drain(self, timeout: float) -> bool:
        """Wait until every queued pull is done (a new handshake; tests). False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not (self._queue or self._busy), timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread (pulls still queued are dropped; one under way ends within a poll slice)."""
        with self._cond:
            self._stopping = True
            self._queue.clear()
            self._cond.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("the KV transfer puller did not stop in %g s", timeout)
            return
        self._ctx.term()

    # --- the puller thread --------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()  # drain() may be waiting
                    self._cond.wait_for(lambda: self._queue or self._stopping)
                    if self._stopping:
                        return
                    pull = self._queue.popleft()
                    self._busy = True
                self._report(pull.pull_id, self._pull(pull))
        finally:
            for sock in self._sockets.values():
                sock.close(linger=0)

    def _pull(self, pull: Pull) -> int:
        """Blocks written: all of ``pull``'s, or 0 (logged, counted by why)."""
        c = self.counters
        t0 = time.perf_counter()
        try:
            self._read_into(pull)
        except PullFailed as e:
            c.failures[e.reason] = c.failures.get(e.reason, 0) + 1
            log.warning("KV transfer: pull %d of %s from %s failed (%s): %s; its blocks are not written",
                        pull.pull_id, pull.request_id, pull.address, e.reason, e)
            return 0
        except Exception:  # noqa: BLE001 -- the thread must outlive any one pull
            c.failures["error"] = c.failures.get("error", 0) + 1
            log.exception("KV transfer: pull %d of %s from %s failed", pull.pull_id, pull.request_id, pull.address)
            return 0
        n = len(pull.block_ids)
        c.pulled_blocks += n
        c.pulled_bytes += n * self.block_bytes
        c.pull_seconds += time.perf_counter() - t0
        return n

    def _read_into(self, pull: Pull) -> None:
        """Ask, wait (bounded), check and write; PullFailed naming why not."""
        try:
            endpoint = tcp_endpoint(pull.address)
        except ValueError as e:
            raise PullFailed("address", str(e)) from None
        sock = self._socket(endpoint)
        try:
            sock.send(ENCODER.encode(PullRequest(pull.request_id, pull.remote_block_ids, self.identity)), zmq.NOBLOCK)
            frames = self._wait_reply(sock)
            reply = REPLY_DECODER.decode(frames[0].buffer)
        except (PullFailed, zmq.ZMQError, msgspec.DecodeError) as e:
            self._drop_socket(endpoint)  # NOTE: a reply may still come, to a socket no one reads
            if isinstance(e, PullFailed):
                raise
            raise PullFailed("timeout" if isinstance(e, zmq.Again) else "reply", f"{type(e).__name__}: {e}") from None
        if not reply.ok:
            raise PullFailed(reply.error or "refused", reply.detail)
        n = len(pull.block_ids)
        if len(frames) != 2 or reply.num_blocks != n or reply.block_bytes != self.block_bytes:
            raise PullFailed("size", f"{len(frames) - 1} payload frames of {reply.num_blocks} blocks of {reply.block_bytes} bytes; "
                                     f"asked {n} blocks of {self.block_bytes}")
        payload = frames[1].buffer
        if payload.nbytes != n * self.block_bytes:
            raise PullFailed("size", f"{payload.nbytes} bytes for {n} blocks of {self.block_bytes}")
        write_blocks(self.kv_caches, pull.block_ids, payload)

    def _wait_reply(self, sock: zmq.Socket) -> list[zmq.Frame]:
        deadline = time.monotonic() + self.read_timeout
        while (left := deadline - time.monotonic()) > 0:
            if self._stopping:
                raise PullFailed("timeout", "the worker is stopping")
            if sock.poll(max(1, round(min(left, POLL_SLICE_S) * 1000))):
                return sock.recv_multipart(copy=False)
        raise PullFailed("timeout", f"no reply within {self.read_timeout:g} s (read_timeout)")

    def _socket(self, endpoint: str) -> zmq.Socket:
        sock = self._sockets.get(endpoint)
        if sock is None:
            sock = socket_for(self._ctx, zmq.DEALER, endpoint)
            sock.connect(endpoint)
            self._sockets[endpoint] = sock
        return sock

    def _drop_socket(self, endpoint: str) -> None:
        sock = self._sockets.pop(endpoint, None)
        if sock is not None:
            sock.close(linger=0)

    def _report(self, pull_id: int, num_blocks: int) -> None:
        with self._lock:
            self._pulled[pull_id] = num_blocks
            self._num_pending -= 1
