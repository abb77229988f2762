"""MooncakeKeyIndex: which keys a Mooncake Store holds, asked of its master.

The KeyIndex (scheduler/core/offload/external_tier.py) of a tier shared with other engines and
evicted by its master: no local list can say what it holds, so every lookup asks the
master (``batch_is_exist``, one round trip for a request's keys) through a client of the
store that lends it no memory.

Saves sent but not yet done are the exception: the worker's single I/O thread runs a
load queued after a save once the save is done, so a key saved counts as held from the
step that sends it (``add``). Those keys are held locally for ``pending_ttl_s`` seconds,
long enough for the worker to write them, after which the master alone answers: a key
the master evicted stops counting, and the local set stays bounded without any word
from the worker that a save succeeded. A key wrongly counted is only a miss (the load
fails its check, the block is computed again).

A master that does not answer holds nothing: ``count_prefix`` is 0 and ``missing`` is
all False (no save is sent to a store that is down). The index then waits ``retry_s``
seconds and asks again only if the master's port accepts a connection, since Mooncake's
client spends seconds on each call to a master that is gone and the scheduler's step
must not.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from protocol.tcp_address import accepts, split_address

log = logging.getLogger("kvpool.scheduler.mooncake_index")

# NOTE: Mooncake's setup retries 20 times, seconds each, while the master refuses it; the
# index checks the master's port first, this bounds the race where it dies in between.
SETUP_RETRIES = "2"
PROBE_TIMEOUT_S = 2.0
WARN_EVERY_S = 30.0


class MooncakeKeyIndex:
    def __init__(
        self,
        master_address: str,
        metadata_server: str,
        local_hostname: str = "127.0.0.1",
        pending_ttl_s: float = 60.0,
        retry_s: float = 5.0,
    ):
        """Ask the master at ``master_address`` (``host:port``; its metadata server is
        ``metadata_server``, ``http://host:port/metadata``). Raises ValueError when the
        master cannot be joined, within seconds."""
        # NOTE: imported here, not above: mooncake is an optional extra, needed only by a
        # scheduler whose tier is a Mooncake Store.
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise ValueError(f"--kv-offloading-backend mooncake needs Mooncake's client (pip install 'kvpool[mooncake]'): {e}") from e
        self.master_address = master_address
        self._master = split_address(master_address, "the Mooncake master's address")
        if not accepts(*self._master, PROBE_TIMEOUT_S):
            raise ValueError(f"the Mooncake master {master_address} does not accept connections")
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", SETUP_RETRIES)
        self._store = MooncakeDistributedStore()
        # No segment and no local buffer: this client only asks.
        rc = self._store.setup(local_hostname, metadata_server, 0, 0, "tcp", "", master_address)
        if rc != 0:
            raise ValueError(f"the Mooncake client could not join the master {master_address} with metadata server {metadata_server} (setup returned {rc}; its log on stderr says why)")
        self.pending_ttl_s = pending_ttl_s
        self.retry_s = retry_s
        # Keys of saves sent -> monotonic time sent, oldest first.
        self.pending: OrderedDict[str, float] = OrderedDict()
        # Monotonic time until which the master counts as gone (None: it answered last).
        self._down_until: float | None = None
        self._warned_at: float | None = None
        # Counter (never reset): lookups the master did not answer.
        self.num_unreachable = 0

    # --- KeyIndex -----------------------------------------------------------------------

    def count_prefix(self, keys: Sequence[str]) -> int:
        """How many of ``keys``, from the first, the store holds (0 when the master is gone)."""
        held = self._held(keys)
        if held is None:
            return 0
        n = 0
        for h in held:
            if h is not True:
                break
            n += 1
        return n

    def held(self, keys: Sequence[str]) -> list[bool]:
        """For each key, True when the store surely holds it (none when the master is gone)."""
        held = self._held(keys)
        return [False] * len(keys) if held is None else [h is True for h in held]

    def missing(self, keys: Sequence[str]) -> list[bool]:
        """For each key, True when the store surely lacks it (none when the master is gone)."""
        held = self._held(keys)
        if held is None:
            return [False] * len(keys)
        return [h is False for h in held]

    def add(self, keys: Iterable[str]) -> None:
        now = time.monotonic()
        pending = self.pending
        for key in keys:
            pending[key] = now
            pending.move_to_end(key)
        self._expire(now)

    def discard(self, keys: Iterable[str]) -> None:
        pending = self.pending
        for key in keys:
            pending.pop(key, None)

    def reset(self, keys: Iterable[str]) -> None:
        """A worker's hello: no save of it is in flight any more. (A Mooncake worker lists
        no keys: the master is asked.)"""
        self.pending.clear()

    # --- the master ---------------------------------------------------------------------

    def _held(self, keys: Sequence[str]) -> list[bool | None] | None:
        """Per key: True held, False not, None unknown (the master's error for it); None
        for the whole when the master did not answer."""
        if not keys:
            return []
        now = time.monotonic()
        self._expire(now)
        pending = self.pending
        ask = [k for k in keys if k not in pending]
        if not ask:
            return [True] * len(keys)
        if not self._master_may_answer(now):
            return None
        codes = self._store.batch_is_exist(ask)
        if len(codes) != len(ask) or all(c < 0 for c in codes):
            self._gone(now, f"batch_is_exist returned {codes[:1] or 'nothing'}")
            return None
        answer = dict(zip(ask, codes, strict=True))
        return [True if k in pending else (None if answer[k] < 0 else answer[k] == 1) for k in keys]

    def _master_may_answer(self, now: float) -> bool:
        """False while the master counts as gone; past ``retry_s``, whether its port accepts."""
        if self._down_until is None:
            return True
        if now < self._down_until:
            self.num_unreachable += 1
            return False
        if not accepts(*self._master, PROBE_TIMEOUT_S):
            self._gone(now, "its port refuses connections")
            return False
        self._down_until = None
        return True

    def _gone(self, now: float, why: str) -> None:
        self.num_unreachable += 1
        self._down_until = now + self.retry_s
        if self._warned_at is None or now - self._warned_at >= WARN_EVERY_S:
            self._warned_at = now
            log.warning("Mooncake master %s did not answer (%s): the external tier counts as empty, no block is saved to it; asking again every %g s",
                        self.master_address, why, self.retry_s)

    def _expire(self, now: float) -> None:
        pending = self.pending
        horizon = now - self.pending_ttl_s
        while pending:
            key, sent = next(iter(pending.items()))
            if sent > horizon:
                break
            del pending[key]

    def close(self) -> None:
        self._store.close()
