"""``--enable-ssl-refresh``: vLLM's SSLCertRefresher. The key and certificate files
(both given) are watched, and the chain reloaded into the server's one SSL context
when either changes; the CA file (``--ssl-ca-certs``) likewise. A reload applies to
connections made after it; a file that fails to load is logged and the context keeps
what it had.

NOTE: vLLM watches with watchfiles (inotify); this polls the files' stat, which sees
writes in place and a file renamed over the path alike. As watchfiles debounces, a
change is acted on once the files have stopped changing for one poll, so a key and
certificate written one after the other load together."""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from collections.abc import Callable

from frontend.config import FrontendConfig

log = logging.getLogger("frontend.ssl")
POLL_S = 0.25


def _stat(paths: list[str]) -> list[tuple[int, int, int] | None]:
    out = []
    for p in paths:
        try:
            st = os.stat(p)
            out.append((st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError:
            out.append(None)
    return out


class SSLCertRefresher:
    def __init__(self, ctx: ssl.SSLContext, config: FrontendConfig, poll_s: float = POLL_S):
        self.ctx, self.poll_s = ctx, poll_s
        self.tasks: list[asyncio.Task] = []
        key, cert, ca = config.ssl_keyfile, config.ssl_certfile, config.ssl_ca_certs
        if key and cert:  # NOTE: as vLLM: a chain without --ssl-keyfile is not watched
            self._watch([key, cert], "certificate chain", lambda: ctx.load_cert_chain(cert, key))
        if ca:
            self._watch([ca], "CA certificates", lambda: ctx.load_verify_locations(ca))

    def _watch(self, paths: list[str], what: str, reload: Callable[[], None]) -> None:
        log.info("SSLCertRefresher monitors files: %s", paths)
        self.tasks.append(asyncio.create_task(self._poll(paths, what, reload), name=f"ssl-refresh {what}"))

    async def _poll(self, paths: list[str], what: str, reload: Callable[[], None]) -> None:
        seen = last = _stat(paths)
        while True:
            await asyncio.sleep(self.poll_s)
            now = _stat(paths)
            if now != seen and now == last:  # changed, then unchanged for one poll
                seen = now
                log.info("Reloading SSL %s", what)
                try:
                    reload()
                except (OSError, ssl.SSLError) as e:
                    log.error("SSLCertRefresher failed taking action on file change. Error: %s", e)
            last = now

    async def stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks.clear()
