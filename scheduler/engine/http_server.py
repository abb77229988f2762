"""The scheduler's HTTP side, on the same event loop: /metrics, /health, /engine_info
(what the frontend tells routers: scheduler/engine/engine_info.py) and the
development endpoint POST /reset_prefix_cache (dev mode only; 404 otherwise).

``EngineCore`` (scheduler/engine/engine_core.py) holds one ``HttpSide``; what the
pages read of the engine is the ``EngineState``, the worker link's readiness and the
metrics, and a reset publishes its KV events through the engine's publisher.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

from aiohttp import web

from scheduler.engine.engine_state import EngineState
from scheduler.engine.metrics import SchedulerMetrics
from scheduler.engine.worker_link import WorkerLink

log = logging.getLogger("scheduler")


class HttpSide:
    def __init__(
        self, state: EngineState, link: WorkerLink, metrics: SchedulerMetrics, publish_kv_events: Callable[[], None],
        host: str, port: int, dev_mode: bool, engine_info: dict | None = None,
    ):  # fmt: skip
        """``publish_kv_events``: the engine's, called after a reset emptied the cache;
        ``engine_info``: GET /engine_info's answer (fixed at start-up)."""
        self.engine_info = engine_info or {}
        self.state = state
        self.link = link
        self.metrics = metrics
        self.publish_kv_events = publish_kv_events
        self.host, self.port, self.dev_mode = host, port, dev_mode

    async def start(self) -> web.AppRunner | None:
        """/metrics, /health (and the dev-mode reset); None, logged, if the port is taken."""
        reset = self.reset_prefix_cache if self.dev_mode else None
        try:
            return await start_http(build_app(self.render_metrics, self.health, reset, self.engine_info), self.host, self.port)
        except OSError as e:
            log.error("cannot start: HTTP on %s:%d: %s (choose another --http-port)", self.host, self.port, e)
            return None

    def render_metrics(self) -> bytes:
        if self.state.scheduler is not None:
            self.metrics.update(self.state.scheduler, self.state.kv)
        return self.metrics.render()

    def health(self) -> tuple[bool, str]:
        if self.state.stopping:
            return False, "shutting down"
        return (True, "ok") if self.link.ready else (False, "no worker is ready")

    def reset_prefix_cache(self) -> tuple[bool, str]:
        kv = self.state.kv
        if kv is None:
            return False, "no pool yet: no worker has connected"
        if kv.reset_prefix_cache():
            self.publish_kv_events()
            return True, "prefix cache reset"
        used = kv.block_pool.num_gpu_blocks - 1 - kv.block_pool.get_num_free_blocks()
        return False, f"refused: {used} blocks are held by running requests"


def build_app(
    render_metrics: Callable[[], bytes],
    is_healthy: Callable[[], tuple[bool, str]],
    reset_prefix_cache: Callable[[], tuple[bool, str]] | None,
    engine_info: dict | None = None,
) -> web.Application:
    app = web.Application()
    info_body = json.dumps(engine_info or {}).encode()

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(body=render_metrics(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def health(_request: web.Request) -> web.Response:
        ok, why = is_healthy()
        return web.Response(status=200 if ok else 503, text=why + "\n")

    async def info(_request: web.Request) -> web.Response:
        return web.Response(body=info_body, content_type="application/json")

    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    app.router.add_get("/engine_info", info)

    if reset_prefix_cache is not None:

        async def reset(_request: web.Request) -> web.Response:
            ok, why = reset_prefix_cache()
            return web.Response(status=200 if ok else 409, text=why + "\n")

        app.router.add_post("/reset_prefix_cache", reset)
    return app


async def start_http(app: web.Application, host: str, port: int) -> web.AppRunner:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
