"""MooncakeStore: KV objects in a Mooncake Store (--kv-offloading-backend mooncake).

A Mooncake Store is a master (``mooncake_master``: which object lives where) and the memory
its clients lend it, in segments: store servers (``mooncake_client``) and any engine that
lends some. This worker's client stages every put and get through a local buffer of
``local_buffer_bytes`` (so no object may be larger) and, by default, lends nothing: an
object in an engine's segment leaves the store with the engine, and the tier is there to
outlive engines (``global_segment_bytes`` lends some all the same). Bytes move over
Mooncake's transfer engine ("tcp" here); the metadata server (the master's own HTTP one,
``http://host:port/metadata``) tells clients how to reach each other's segments.

The same interface as DiskStore (worker/external/disk_store.py), with three differences:

* ``put`` never returns removed keys: the master evicts on its own and tells nobody; the
  scheduler asks the master what it holds (scheduler/core/offload/mooncake_index.py), so
  ``keys()`` is empty.
* "full" is usually transient: the master evicts in the background, a share of the pool
  at a time, once it passes a high watermark, so a put that finds no room (no segment
  has any, or every object in the way is leased: a read or an existence check leases
  an object for seconds) fails, and one a moment later succeeds.
* Every failure talking to the store raises StoreError. After an "unreachable", the store
  answers "unreachable" at once for ``RETRY_S`` seconds, then asks the master again only
  if its port accepts a connection: Mooncake's client spends seconds on each call to a
  master that is gone, and the I/O thread must not.

Not thread-safe: one I/O thread owns it (worker/external/external_io.py).
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from urllib.parse import urlsplit

from protocol.tcp_address import accepts, split_address
from worker.external.store_errors import StoreError

log = logging.getLogger("kvpool.worker.mooncake_store")

DEFAULT_LOCAL_BUFFER_BYTES = 64 << 20
# The first size of the buffer gets read into; it grows to the largest object read.
READ_BUFFER_BYTES = 1 << 20
# NOTE: Mooncake's setup retries 20 times, seconds each, while the master refuses it, and
# holds the GIL throughout (a thread with a timeout cannot bound it). The store checks the
# master's port first; this bounds the race where the master dies in between.
SETUP_RETRIES = "2"
PROBE_TIMEOUT_S = 2.0
RETRY_S = 5.0

# Mooncake's ErrorCode (mooncake-store/include/types.h), the ones told apart here.
OK = 0
BUFFER_OVERFLOW = -10
NO_AVAILABLE_HANDLE = -200  # no segment has room for the object
INVALID_PARAMS = -600  # also: the buffer given to get_into is too small
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
RPC_FAIL = -900  # -900 .. -999: the master did not answer


def reason_of(rc: int) -> str:
    """StoreError's reason for Mooncake's error code ``rc``."""
    if rc in (NO_AVAILABLE_HANDLE, BUFFER_OVERFLOW):
        return "full"
    if -1000 < rc <= RPC_FAIL:
        return "unreachable"
    return "io"


class MooncakeStore:
    name = "mooncake"
    # "full" (-200) passes once the master's background eviction ran: a short pause, not the tier's 30 s.
    full_pause_s = 1.0

    def __init__(
        self,
        master_address: str,
        metadata_server: str,
        global_segment_bytes: int = 0,
        local_buffer_bytes: int = DEFAULT_LOCAL_BUFFER_BYTES,
        local_hostname: str = "127.0.0.1",
    ):
        """Join the store of the master at ``master_address`` (``host:port``) whose metadata
        server is ``metadata_server`` (``http://host:port/metadata``), lending it
        ``global_segment_bytes`` of this process's memory (default none). Raises ValueError for a malformed
        argument, StoreError("unreachable") when the master or the metadata server does
        not answer, within seconds."""
        # NOTE: imported here, not above: mooncake is an optional extra, needed only by a
        # worker that names this backend.
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise ValueError(f"--kv-offloading-backend mooncake needs Mooncake's client (pip install 'kvpool[mooncake]'): {e}") from e

        if global_segment_bytes < 0 or local_buffer_bytes < 1:
            raise ValueError(f"the Mooncake client needs a segment >= 0 and a local buffer > 0 bytes, got {global_segment_bytes} and {local_buffer_bytes}")
        self.master_address = master_address
        self.local_buffer_bytes = local_buffer_bytes
        self._master = split_address(master_address, "the Mooncake master's address")
        probes = [("master", master_address, self._master)]
        url = urlsplit(metadata_server)
        if url.scheme in ("http", "https"):
            if url.hostname is None:
                raise ValueError(f"the Mooncake metadata server {metadata_server!r} names no host")
            meta = (url.hostname, url.port or (443 if url.scheme == "https" else 80))
            probes.append(("metadata server", metadata_server, meta))
        for what, text, (host, port) in probes:
            if not accepts(host, port, PROBE_TIMEOUT_S):
                raise StoreError("unreachable", f"the Mooncake {what} {text} does not accept connections")
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", SETUP_RETRIES)
        self._store = MooncakeDistributedStore()
        rc = self._store.setup(local_hostname, metadata_server, global_segment_bytes, local_buffer_bytes,
                               "tcp", "", master_address)
        if rc != OK:
            raise StoreError("unreachable", f"the Mooncake client could not join the master {master_address} (setup returned {rc}; its log on stderr says why)")
        log.info("joined the Mooncake master %s, lending it %d bytes, staging through %d", master_address, global_segment_bytes, local_buffer_bytes)
        self._read_buf: ctypes.Array | None = None
        self._grow_read_buffer(READ_BUFFER_BYTES)
        # monotonic time until which the master counts as gone (None: it answered last).
        self._down_until: float | None = None
        self._closed = False

    # --- reads --------------------------------------------------------------------------

    def keys(self) -> list[str]:
        """Nothing: what a shared store holds is the master's to say (scheduler/core/offload/mooncake_index.py)."""
        return []

    def __contains__(self, key: str) -> bool:
        self._check_master()
        rc = self._store.is_exist(key)
        if rc < 0:
            self._fail(rc, f"checking {key}")
        return rc == 1

    def get(self, key: str) -> bytes | None:
        """The object under ``key`` (unchecked), or None when the store has none."""
        self._check_master()
        n = self._get_into(key)
        if n == INVALID_PARAMS:
            # The read buffer may be too small for this object: grow it and try once more.
            size = self._store.get_size(key)
            if size == OBJECT_NOT_FOUND:
                return None
            if size < 0:
                self._fail(size, f"reading {key}")
            if size > len(self._read_buf):
                self._grow_read_buffer(size)
                n = self._get_into(key)
        if n == OBJECT_NOT_FOUND:
            return None
        if n < 0:
            self._fail(n, f"reading {key}")
        return bytes(memoryview(self._read_buf)[:n])

    def _get_into(self, key: str) -> int:
        buf = self._read_buf
        return self._store.get_into(key, ctypes.addressof(buf), len(buf))

    def _grow_read_buffer(self, size: int) -> None:
        old = self._read_buf
        if old is not None:
            self._store.unregister_buffer(ctypes.addressof(old))
        buf = (ctypes.c_ubyte * size)()
        # NOTE: registered so that a transport that writes straight into memory (RDMA) may;
        # over TCP get_into works either way.
        if self._store.register_buffer(ctypes.addressof(buf), size) != OK:
            raise StoreError("io", f"the Mooncake client refused to register a read buffer of {size} bytes")
        self._read_buf = buf

    # --- writes -------------------------------------------------------------------------

    def put(self, key: str, header: bytes, payload: bytes | memoryview) -> list[str]:
        """Write one object (``header`` then ``payload``) under ``key``. Returns [] (the
        master evicts without telling). Raises StoreError when the store cannot take it."""
        size = len(header) + len(payload)
        if size > self.local_buffer_bytes:
            raise StoreError("full", f"an object of {size} bytes exceeds the Mooncake client's local buffer of {self.local_buffer_bytes} bytes")
        self._check_master()
        # put_parts copies both parts into the local buffer once, with no joined copy first.
        rc = self._store.put_parts(key, header, payload)
        # A key names its bytes (protocol/external_kv.py): one already there is this object.
        if rc not in (OK, OBJECT_ALREADY_EXISTS):
            self._fail(rc, f"writing {key} ({size} bytes)")
        return []

    def remove(self, key: str) -> None:
        """Drop the object under ``key`` (a bad one), if any."""
        self._check_master()
        # force: an object read in the last seconds holds a lease that a plain remove respects.
        rc = self._store.remove(key, True)
        if rc not in (OK, OBJECT_NOT_FOUND):
            self._fail(rc, f"removing {key}")

    # --- the master ---------------------------------------------------------------------

    def _check_master(self) -> None:
        """Raise StoreError("unreachable") at once while the master counts as gone."""
        if self._down_until is None:
            return
        now = time.monotonic()
        if now >= self._down_until:
            if accepts(*self._master, PROBE_TIMEOUT_S):
                self._down_until = None
                return
            self._down_until = now + RETRY_S
        raise StoreError("unreachable", f"the Mooncake master {self.master_address} did not answer; asking again in at most {RETRY_S:g} s")

    def _fail(self, rc: int, doing: str) -> None:
        reason = reason_of(rc)
        if reason == "unreachable":
            self._down_until = time.monotonic() + RETRY_S
        raise StoreError(reason, f"Mooncake store (master {self.master_address}): {doing}: error {rc}")

    def close(self) -> None:
        """Leave the store: the objects in this client's segment go with it."""
        if self._closed:
            return
        self._closed = True
        self._store.close()
