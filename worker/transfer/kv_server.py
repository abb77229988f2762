"""KVServer: a prefill engine's worker serves the blocks its scheduler lends to decode
engines' workers (P/D disaggregation, protocol/kv_pull_wire.py), on a thread of its own.

The process loop's thread lends a finished request's blocks (`lend`) and takes lends back
(`unlend`, a lease ran out) as a plan's ``KVTransferOps`` arrive, before that plan's
forward. The server thread answers each ``PullRequest`` on a ZMQ ROUTER: the blocks'
bytes (worker/kv/kv_block_bytes.py) gathered into host memory and sent as one frame, after
which the lend is gone and the request id is reported read (`take_sent`), so the
scheduler frees the blocks.

NOTE: a read gathers under ``_lock``, and `unlend` takes the same lock: once `unlend`
returns, no read of those blocks is under way or can start, so the plan's forward may
reuse them. A served read's bytes are in host memory before the lock is released.

A read may reach the server before the lend it asks for (the lend travels in the prefill
scheduler's next plan): it is parked, not refused, and tried again at each poll tick for
up to ``lend_wait_s``; other reads go on meanwhile. Refusals (protocol/kv_pull_wire.py
REFUSALS) are replies, never a crash: a malformed frame, another identity, a request not
lent, blocks not among those lent.

A request is lent one list of blocks per KV-cache group (a hybrid model's: every group's
table, a sliding group's in-window tail); a read names one list per group too, each a
consecutive run of that group's lent list in its order (`is_lent_run`), and gets their
bytes group after group. A block id means the same memory in every group (each KV tensor
is shared by one layer of each group), so a block is read alike whatever group lent it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import msgspec
import torch
import zmq

from protocol.kv_pull_wire import PullReply, PullRequest
from worker.kv.kv_block_bytes import block_bytes, gather_blocks
from worker.transfer.side_channel import ENCODER, REQUEST_DECODER, host_port, socket_for

log = logging.getLogger("kvpool.worker.transfer")

# How long a read of a request not lent (yet) waits for its lend before it is refused.
LEND_WAIT_S = 5.0
# The server thread's poll: short while a read is parked, else long enough to stay idle
# (and to see `close` within it).
PARKED_POLL_MS = 2
IDLE_POLL_MS = 100


@dataclass(slots=True)
class ServerCounters:
    """Running totals, read by the worker's metrics (worker/transfer/transfer_metrics.py)."""

    served_blocks: int = 0
    served_bytes: int = 0
    serve_seconds: float = 0.0
    refusals: dict[str, int] = field(default_factory=dict)  # by PullReply.error


@dataclass(slots=True)
class _ParkedRead:
    peer: bytes
    request: PullRequest
    until: float  # time.monotonic() past which it is refused "unknown"


class KVServer:
    """Serves blocks of ``kv_caches`` (one per layer, (2, blocks, bs, kvh, hd)) lent by id,
    to readers of the same ``identity``, at ``host:port`` (port 0: any free one; `address`)."""

    def __init__(self, kv_caches: list[torch.Tensor], identity: str, host: str, port: int, lend_wait_s: float = LEND_WAIT_S):
        self.kv_caches = kv_caches
        self.identity = identity
        self.block_bytes = block_bytes(kv_caches)
        self.lend_wait_s = lend_wait_s
        self.counters = ServerCounters()
        self._ctx = zmq.Context()
        endpoint = f"tcp://{host_port(host, port or '*')}"
        self._sock = socket_for(self._ctx, zmq.ROUTER, endpoint)
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError as e:
            self._sock.close()
            self._ctx.term()
            raise ValueError(f"--kv-transfer-config: cannot bind the side channel at {endpoint}: {e}") from None
        bound_port = int(self._sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        # What decode engines' workers connect to (WorkerHello.kv_transfer_address).
        self.address = host_port(host, bound_port)
        self._lock = threading.Lock()
        self._lends: dict[str, list[list[int]]] = {}  # request id -> its lent block ids, one list per KV-cache group
        self._sent: list[str] = []
        self._parked: list[_ParkedRead] = []  # the server thread's own
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-transfer-server", daemon=True)
        self._thread.start()

    # --- the process loop's side ---------------------------------------------------

    def lend(self, request_id: str, block_ids: list[list[int]]) -> None:
        """Blocks ``block_ids`` (one list per KV-cache group) of ``request_id`` may be read (once) from now on."""
        with self._lock:
            self._lends[request_id] = [list(g) for g in block_ids]

    def unlend(self, request_ids: list[str]) -> None:
        """Take lends back; on return no read of their blocks is under way, and none will be served."""
        with self._lock:
            for request_id in request_ids:
                self._lends.pop(request_id, None)

    def unlend_all(self) -> None:
        """Every lend taken back and the news of reads dropped (a new scheduler: ids of the last mean nothing)."""
        with self._lock:
            self._lends.clear()
            self._sent.clear()

    @property
    def has_lends(self) -> bool:
        """Whether any lend waits for its read (a read of the dict's size, no lock needed)."""
        return bool(self._lends)

    def take_sent(self) -> list[str]:
        """The request ids read since the last call (their blocks may be freed)."""
        with self._lock:
            sent, self._sent = self._sent, []
        return sent

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread (within a poll tick) and close the socket."""
        self._stopping.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("the KV transfer server did not stop in %g s", timeout)
            return
        self._ctx.term()

    # --- the server thread -----------------------------------------------------------

    def _run(self) -> None:
        sock = self._sock
        try:
            while not self._stopping.is_set():
                if sock.poll(PARKED_POLL_MS if self._parked else IDLE_POLL_MS):
                    while (frames := self._recv()) is not None:
                        self._on_frames(frames)
                if self._parked:
                    self._retry_parked()
        finally:
            sock.close(linger=0)

    def _recv(self) -> list[bytes] | None:
        try:
            return self._sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return None

    def _on_frames(self, frames: list[bytes]) -> None:
        peer = frames[0]
        try:
            if len(frames) != 2:
                raise msgspec.DecodeError(f"{len(frames) - 1} frames, not 1")
            request = REQUEST_DECODER.decode(frames[1])
        except msgspec.DecodeError as e:
            self._refuse(peer, "malformed", str(e))
            return
        self._answer_safely(peer, request, time.monotonic() + self.lend_wait_s)

    def _retry_parked(self) -> None:
        parked, self._parked = self._parked, []
        for read in parked:
            self._answer_safely(read.peer, read.request, read.until)

    def _answer_safely(self, peer: bytes, request: PullRequest, until: float) -> None:
        try:
            self._answer(peer, request, until)
        except Exception as e:  # noqa: BLE001 -- the thread must outlive any one read
            log.exception("KV transfer: serving %s failed", request.request_id)
            self._refuse(peer, "malformed", f"the server failed: {e}")

    def _answer(self, peer: bytes, request: PullRequest, until: float) -> None:
        """Serve ``request``, refuse it, or park it until its lend comes (up to ``until``)."""
        if request.identity != self.identity:
            self._refuse(peer, "identity", f"this worker's KV identity is {self.identity}, the reader's {request.identity}")
            return
        t0 = time.perf_counter()
        with self._lock:
            lent = self._lends.get(request.request_id)
            if lent is not None and is_lent_run(request.block_ids, lent):
                flat = [b for group in request.block_ids for b in group]
                payload = gather_blocks(self.kv_caches, flat).numpy()  # (n, block_bytes), host memory
                del self._lends[request.request_id]
                self._sent.append(request.request_id)
            else:
                payload = None
        if payload is None:
            if lent is not None:
                self._refuse(peer, "blocks", f"{request.request_id}: blocks {request.block_ids} are not a run of those lent "
                                             f"in each KV-cache group, in order")
            elif time.monotonic() < until:
                self._parked.append(_ParkedRead(peer, request, until))
            else:
                self._refuse(peer, "unknown", f"{request.request_id} is not lent (never, read already, or taken back)")
            return
        n = len(payload)  # (n, block_bytes): every group's blocks
        reply = PullReply(ok=True, num_blocks=n, block_bytes=self.block_bytes)
        # NOTE: counted before the send: a reader that has its blocks finds them counted.
        c = self.counters
        c.served_blocks += n
        c.served_bytes += n * self.block_bytes
        # NOTE: zero-copy: ZMQ holds the array until the frame is on the wire.
        self._sock.send_multipart([peer, ENCODER.encode(reply), payload], copy=False)
        c.serve_seconds += time.perf_counter() - t0

    def _refuse(self, peer: bytes, error: str, detail: str) -> None:
        log.warning("KV transfer: refused a read (%s): %s", error, detail)
        self.counters.refusals[error] = self.counters.refusals.get(error, 0) + 1
        self._sock.send_multipart([peer, ENCODER.encode(PullReply(ok=False, error=error, detail=detail))])


def is_lent_run(block_ids: list[list[int]], lent: list[list[int]]) -> bool:
    """Whether ``block_ids`` name, for each KV-cache group of ``lent``, a consecutive run of
    that group's lent blocks in the table's order (or none of them), and at least one block
    in all: a decode engine reads the blocks after its own hits, a sliding group's within
    its window. Any other list would put one block's KV at another's positions."""
    if len(block_ids) != len(lent) or not any(block_ids):
        return False
    return all(_is_run_of(asked, given) for asked, given in zip(block_ids, lent, strict=True) if asked)


def _is_run_of(block_ids: list[int], lent: list[int]) -> bool:
    if block_ids[0] not in lent:
        return False
    start = lent.index(block_ids[0])
    return lent[start : start + len(block_ids)] == block_ids
