"""The frontend's client of the scheduler's HTTP port (``--scheduler-http``): its
``/health``, ``/metrics`` and ``/engine_info``, and the POST routes the frontend forwards
(cache pins, the prefix-cache reset). One aiohttp session, opened at start-up.

A scheduler that cannot be reached is a 503 (``frontend.schema.errors.unavailable``),
except for ``/health`` (``health`` says why) and ``/metrics`` (the frontend's own lines
are still served)."""

from __future__ import annotations

import logging

import aiohttp

from frontend.schema.errors import unavailable

log = logging.getLogger("frontend")
TIMEOUT_S = 5.0


class SchedulerHTTP:
    def __init__(self, base_url: str):
        self.base_url = base_url
        self.session: aiohttp.ClientSession | None = None  # None until open()

    async def open(self) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT_S))

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def health(self) -> tuple[bool, str]:
        """(ready, the scheduler's reason when not): its /health answer, or why it is unreachable."""
        try:
            async with self.session.get(self.base_url + "/health") as r:
                return r.status == 200, (await r.text()).strip()
        except (aiohttp.ClientError, TimeoutError) as e:
            return False, f"the scheduler's /health is unreachable: {e}"

    async def metrics(self) -> bytes:
        """The scheduler's /metrics page; empty (and a warning) when it cannot be had."""
        try:
            async with self.session.get(self.base_url + "/metrics") as r:
                if r.status == 200:
                    return await r.read()
        except (aiohttp.ClientError, TimeoutError) as e:
            log.warning("scheduler /metrics unreachable: %s", e)
        return b""

    async def engine_info(self) -> dict:
        """The scheduler's GET /engine_info (scheduler/engine/engine_info.py); 503 when unreachable."""
        try:
            async with self.session.get(self.base_url + "/engine_info") as r:
                if r.status == 200:
                    return await r.json()
                raise unavailable(f"the scheduler's /engine_info answered {r.status}")
        except (aiohttp.ClientError, TimeoutError) as e:
            raise unavailable(f"the scheduler is unreachable: {e}") from None

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        """POST ``body`` (JSON) to the scheduler's HTTP ``path``: (status, its body)."""
        try:
            async with self.session.post(self.base_url + path, data=body, headers={"Content-Type": "application/json"}) as r:
                return r.status, await r.read()
        except (aiohttp.ClientError, TimeoutError) as e:
            raise unavailable(f"the scheduler is unreachable: {e}") from None

    async def reset_prefix_cache(self) -> tuple[int, str]:
        """The scheduler's answer to POST /reset_prefix_cache: (status, its text)."""
        try:
            async with self.session.post(self.base_url + "/reset_prefix_cache") as r:
                return r.status, await r.text()
        except (aiohttp.ClientError, TimeoutError) as e:
            raise unavailable(f"the scheduler is unreachable: {e}") from None
