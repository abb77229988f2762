"""The scheduler's HTTP side, on the same event loop: /metrics, /health and the
development endpoint POST /reset_prefix_cache (dev mode only; 404 otherwise)."""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web


def build_app(
    render_metrics: Callable[[], bytes],
    is_healthy: Callable[[], tuple[bool, str]],
    reset_prefix_cache: Callable[[], tuple[bool, str]] | None,
) -> web.Application:
    app = web.Application()

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(body=render_metrics(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def health(_request: web.Request) -> web.Response:
        ok, why = is_healthy()
        return web.Response(status=200 if ok else 503, text=why + "\n")

    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)

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
