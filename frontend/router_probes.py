"""What vllm-router probes besides vLLM's own routes (SGLang's names;
docs/architecture.md): the render endpoints (``frontend.render``),
``/get_model_info``, ``/get_server_info``, ``/get_load``, ``/health_generate`` and
``/flush_cache`` (dev mode)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import msgspec
from aiohttp import web

from frontend.engine_client import EngineError
from frontend.errors import APIError, unavailable
from frontend.protocol import ChatCompletionRequest, CompletionRequest
from frontend.render import render_chat, render_completion
from frontend.request_body import read_body
from frontend.serving import json_response, random_id
from frontend.version import kvpool_version

if TYPE_CHECKING:
    from frontend.api_server import APIServer

# GET /health_generate: the most a one-token generation may take before it is a failure.
HEALTH_GENERATE_TIMEOUT_S = 30.0


def router_probe_routes(server: APIServer) -> list[tuple[str, str, object]]:
    ctx, config = server.ctx, server.config

    async def render_completion_(request: web.Request) -> web.Response:
        body = await render_completion(ctx, await read_body(request, CompletionRequest))
        return web.Response(body=msgspec.json.encode(body), content_type="application/json")

    async def render_chat_(request: web.Request) -> web.Response:
        return json_response(await render_chat(ctx, await read_body(request, ChatCompletionRequest)))

    async def model_info(_request: web.Request) -> web.Response:
        return json_response({"model_path": ctx.model_path, "tokenizer_path": ctx.model_path, "is_generation": True,
                              "served_model_name": ctx.model_name, "max_model_len": ctx.max_model_len})  # fmt: skip

    async def server_info(_request: web.Request) -> web.Response:
        c = config
        return json_response({"version": kvpool_version(), "model_path": c.model, "served_model_name": c.served_model_name,
                              "max_model_len": c.max_model_len, "dev_mode": c.dev_mode, "ready": server.ready,
                              "status": "ready" if server.ready else server.why_not_ready, "load": server.engine.num_in_flight})  # fmt: skip

    async def get_load(_request: web.Request) -> web.Response:
        # The engine requests this server has running or waiting (vllm-router reads "load").
        return json_response({"load": server.engine.num_in_flight})

    async def health_generate(_request: web.Request) -> web.Response:
        """200 once a one-token generation has come back: the worker really computes."""
        server.require_ready()
        try:
            async with asyncio.timeout(HEALTH_GENERATE_TIMEOUT_S):
                async for _ in server.engine.generate(random_id("health"), [0], {"max_tokens": 1, "ignore_eos": True}):
                    pass
        except EngineError as e:
            raise unavailable(f"a one-token generation failed: {e}") from None
        except TimeoutError:
            raise unavailable(f"a one-token generation did not finish within {HEALTH_GENERATE_TIMEOUT_S:g} s") from None
        return web.Response(text="")

    async def flush_cache(_request: web.Request) -> web.Response:
        if not config.dev_mode:
            raise APIError("POST /flush_cache resets the prefix cache, a development endpoint: start the server with "
                           "--dev-mode (as for /reset_prefix_cache)", 403)  # fmt: skip
        status, text = await server.scheduler_reset_prefix_cache()
        return web.Response(status=status, text=text)

    return [
        ("POST", "/v1/completions/render", render_completion_),
        ("POST", "/v1/chat/completions/render", render_chat_),
        ("GET", "/get_model_info", model_info),
        ("GET", "/get_server_info", server_info),
        ("GET", "/get_load", get_load),
        ("GET", "/health_generate", health_generate),
        ("POST", "/flush_cache", flush_cache),
    ]
