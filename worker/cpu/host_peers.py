"""Whether other kvpool workers run on this host, so that a worker takes the spare core
for its big steps (worker/cpu/threads.py `StepThreads`) only when it is the only one.

Each worker holds an exclusive ``flock`` on a file of its own in a per-user directory
of the temp dir, for as long as it lives (the kernel drops the lock when the process
ends, however it ends). Another worker's file whose lock can be taken belongs to a
worker that is gone: it is removed. The directory is read at most once per
``interval_s``.

Why: libgomp (torch's OpenMP) keeps a thread that finished its share of a parallel
region spinning before it sleeps, and cannot see other processes. Two replicas on one
host, each going wide, spin on each other's cores, and ran several times slower than
with every step narrow. A shorter spin (GOMP_SPINCOUNT) fixed the pair but slowed a lone
replica's decode, and a replica alone is what the wide steps are for
(docs/benchmarks.md, "2026-12-03, 21:55").
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import math
import os
import secrets
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 1.0


def default_directory() -> Path:
    return Path(tempfile.gettempdir()) / f"kvpool-workers-{os.getuid()}"


class HostPeers:
    """This worker's presence on the host, and whether it has company; see the module doc."""

    def __init__(self, directory: Path | None = None, interval_s: float = DEFAULT_INTERVAL_S):
        self.directory = Path(directory or default_directory())
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        # NOTE: a name of its own (not the pid alone, which is reused), so that a stale
        # file is never opened again once its worker is gone.
        self.path = self.directory / f"{os.getpid()}-{secrets.token_hex(4)}.lock"
        self._fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self.interval_s = interval_s
        self._checked = -math.inf
        self._alone = True

    def alone(self, now: float) -> bool:
        """No other live worker on this host, as of the last look (at most ``interval_s``
        before ``now``, a monotonic time)."""
        if now - self._checked >= self.interval_s:
            self._checked = now
            alone = not self._others()
            if alone != self._alone:
                log.info("%s kvpool worker on this host: big steps %s", "no other" if alone else "another",
                         "take every core again" if alone else "stay on the usual threads")
            self._alone = alone
        return self._alone

    @property
    def seen_alone(self) -> bool:
        """``alone``'s last answer, without looking again."""
        return self._alone

    def _others(self) -> bool:
        found = False
        for name in os.listdir(self.directory):
            path = self.directory / name
            if path == self.path or not name.endswith(".lock"):
                continue
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:
                continue  # removed meanwhile
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                found = True  # held: its worker lives
            else:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()  # its worker is gone
            finally:
                os.close(fd)
        return found

    def close(self) -> None:
        if self._fd < 0:
            return
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        os.close(self._fd)
        self._fd = -1
