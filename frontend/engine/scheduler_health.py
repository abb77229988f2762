"""Whether the scheduler is ready, as its ``/health`` last answered (polled every
``HEALTH_POLL_S``): the frontend's own ``/health`` (503 with the scheduler's reason until
it has a worker) and the gate every generation passes."""

from __future__ import annotations

import asyncio

from aiohttp import web

from frontend.engine.scheduler_http import SchedulerHTTP
from frontend.schema.errors import unavailable

HEALTH_POLL_S = 0.5


class SchedulerHealth:
    def __init__(self, scheduler: SchedulerHTTP):
        self.scheduler = scheduler
        self.ready, self.why_not_ready = False, "the scheduler has not answered yet"
        self.was_ready = False  # ready at least once since this frontend started

    async def check(self) -> bool:
        """One look at the scheduler's /health (also the engine client's, after a lost connection)."""
        if self.scheduler.session is None:
            return False
        self.ready, self.why_not_ready = await self.scheduler.health()
        self.was_ready |= self.ready
        return self.ready

    async def poll(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_POLL_S)
            await self.check()

    def require_ready(self) -> None:
        # NOTE: only until the scheduler was first ready. After that a missing worker
        # is a restart: the scheduler queues new requests until one is back (or its
        # --worker-reconnect-timeout passes), so they must reach it.
        if not self.ready and not self.was_ready:
            raise unavailable(f"The server is not ready: {self.why_not_ready}")

    async def health(self, _request: web.Request) -> web.Response:
        """GET /health (and /ping): 200 when ready, else 503 with the reason."""
        return web.Response(status=200 if self.ready else 503, text="" if self.ready else self.why_not_ready + "\n")
