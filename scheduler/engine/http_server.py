"""The scheduler's HTTP side, on the same event loop: /metrics, /health, /engine_info
(what the frontend tells routers: scheduler/engine/engine_info.py), the development
endpoint POST /reset_prefix_cache (dev mode only; 404 otherwise) and POST
/v1/cache/pin, /v1/cache/unpin (the API server's, forwarded: `PinPrefix`).

``EngineCore`` (scheduler/engine/engine_core.py) holds one ``HttpSide``; what the
pages read of the engine is the ``EngineState``, the worker link's readiness and the
metrics, and a reset publishes its KV events through the engine's publisher.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

import msgspec
from aiohttp import web

from protocol.client_messages import PinPrefix, PinResult
from scheduler.core.hashing import BlockHasher
from scheduler.core.retention.pinned_blocks import PinRefused
from scheduler.core.vllm_hashing import VllmBlockHasher
from scheduler.engine.engine_state import EngineState
from scheduler.engine.metrics import SchedulerMetrics
from scheduler.engine.worker_link import WorkerLink

log = logging.getLogger("scheduler")


class HttpSide:
    def __init__(
        self, state: EngineState, link: WorkerLink, metrics: SchedulerMetrics, publish_kv_events: Callable[[], None],
        host: str, port: int, dev_mode: bool, engine_info: dict | None = None, hasher: BlockHasher | VllmBlockHasher | None = None,
    ):
        """``publish_kv_events``: the engine's, called after a reset emptied the cache;
        ``engine_info``: GET /engine_info's answer (fixed at start-up)."""
        self.engine_info = engine_info or {}
        self.state = state
        self.link = link
        self.metrics = metrics
        self.publish_kv_events = publish_kv_events
        self.host, self.port, self.dev_mode = host, port, dev_mode
        self.hasher = hasher

    async def start(self) -> web.AppRunner | None:
        """/metrics, /health (and the dev-mode reset); None, logged, if the port is taken."""
        reset = self.reset_prefix_cache if self.dev_mode else None
        try:
            app = build_app(self.render_metrics, self.health, reset, self.engine_info)
            if self.hasher is not None:
                add_pin_routes(app, self.pin)
            return await start_http(app, self.host, self.port)
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
        num_pinned = kv.pinned.num_pinned_blocks
        if kv.reset_prefix_cache():
            self.publish_kv_events()
            if num_pinned:
                log.warning("prefix cache reset: %d pinned blocks released, the pins are cleared", num_pinned)
                return True, f"prefix cache reset; {num_pinned} pinned blocks released (the pins are cleared)"
            return True, "prefix cache reset"
        used = kv.block_pool.num_gpu_blocks - 1 - kv.block_pool.get_num_free_blocks()
        return False, f"refused: {used} blocks are held by running requests"


    def pin(self, body: PinPrefix, unpin: bool) -> tuple[int, bytes]:
        """Pin or unpin ``body``'s full blocks: (HTTP status, JSON body)."""
        kv = self.state.kv
        if kv is None:
            return 503, msgspec.json.encode({"error": "no pool yet: no worker has connected"})
        if not kv.enable_caching:
            return 400, msgspec.json.encode({"error": "the prefix cache is off (--no-enable-prefix-caching): there is nothing to pin"})
        hashes = self.hasher.block_hashes(body.prompt_token_ids, body.cache_salt)
        if unpin:
            out = kv.pinned.unpin(hashes)
        else:
            try:
                out = kv.pinned.pin(hashes, time.monotonic(), body.ttl_s, len(body.prompt_token_ids))
            except PinRefused as e:
                return 400, msgspec.json.encode({"error": str(e)})
        size = self.hasher.block_size
        return 200, msgspec.json.encode(PinResult(out.num_blocks, out.num_blocks * size, out.num_missing, size))


def add_pin_routes(app: web.Application, pin: Callable[[PinPrefix, bool], tuple[int, bytes]]) -> None:
    decoder = msgspec.json.Decoder(PinPrefix)

    def route(unpin: bool):
        async def handle(request: web.Request) -> web.Response:
            try:
                body = decoder.decode(await request.read())
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                return web.json_response({"error": f"invalid pin request: {e}"}, status=400)
            status, text = pin(body, unpin)
            return web.Response(status=status, body=text, content_type="application/json")

        return handle

    app.router.add_post("/v1/cache/pin", route(False))
    app.router.add_post("/v1/cache/unpin", route(True))


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
