"""What vllm-router probes besides vLLM's own routes (SGLang's names;
docs/architecture.md): the render endpoints (``frontend.openai.render``),
``/get_model_info``, ``/get_server_info``, ``/get_load``, ``/health_generate`` and
``/flush_cache`` (dev mode); and vLLM's ``/kv_event_sources``.

vllm-router's ``kv_aware`` discovers a worker's KV events over HTTP: ``/kv_event_sources``
(vLLM's: the publisher config per data-parallel rank) for where to subscribe, and the
``vllm_config`` of ``/get_server_info`` (``model_config.model``, ``cache_config.block_size``)
for the cache identity and the block size; without them it indexes nothing. Both come
from the scheduler's ``/engine_info`` (scheduler/engine/engine_info.py), read once.
"""

from __future__ import annotations

import asyncio

import msgspec
from aiohttp import web

from frontend.engine.outputs import EngineError
from frontend.engine.scheduler_health import SchedulerHealth
from frontend.engine.scheduler_http import SchedulerHTTP
from frontend.http.request_body import read_body
from frontend.openai.render import render_chat, render_completion
from frontend.openai.serving import ServingContext, json_response, random_id
from frontend.schema.errors import APIError, unavailable
from frontend.schema.requests import ChatCompletionRequest, CompletionRequest
from frontend.version import kvpool_version

# GET /health_generate: the most a one-token generation may take before it is a failure.
HEALTH_GENERATE_TIMEOUT_S = 30.0


def vllm_config(model: str, served_model_name: str, max_model_len: int, info: dict) -> dict:
    """The part of vLLM's VllmConfig (as ``/server_info?config_format=json`` dumps it) a router reads."""
    return {"model_config": {"model": model, "served_model_name": served_model_name, "max_model_len": max_model_len},
            "cache_config": dict(info.get("cache_config", {})),
            "parallel_config": {"data_parallel_size": 1, "data_parallel_rank": info.get("data_parallel_rank", 0)}}


def kv_event_sources(info: dict) -> dict:
    """vLLM's /kv_event_sources: {rank: KVEventsConfig}, {} when nothing is published."""
    config = info.get("kv_events_config")
    return {} if config is None else {str(info.get("data_parallel_rank", 0)): config}


def router_probe_routes(ctx: ServingContext, health: SchedulerHealth, scheduler: SchedulerHTTP) -> list[tuple[str, str, object]]:
    config, engine = ctx.config, ctx.engine
    cached_info: list[dict] = []

    async def engine_info() -> dict:
        # NOTE: fixed for the scheduler's life, so read once; a failure is not cached.
        if not cached_info:
            cached_info.append(await scheduler.engine_info())
        return cached_info[0]

    async def render_completion_(request: web.Request) -> web.Response:
        body = await render_completion(ctx, await read_body(request, CompletionRequest))
        return web.Response(body=msgspec.json.encode(body), content_type="application/json")

    async def render_chat_(request: web.Request) -> web.Response:
        return json_response(await render_chat(ctx, await read_body(request, ChatCompletionRequest)))

    async def model_info(_request: web.Request) -> web.Response:
        return json_response({"model_path": ctx.config.model, "tokenizer_path": ctx.config.model, "is_generation": True,
                              "served_model_name": ctx.config.served_model_name, "max_model_len": ctx.config.max_model_len})

    async def server_info(_request: web.Request) -> web.Response:
        c = config
        info = await engine_info()
        return json_response({"version": kvpool_version(), "model_path": c.model, "served_model_name": c.served_model_name,
                              "max_model_len": c.max_model_len, "dev_mode": c.dev_mode, "ready": health.ready,
                              "status": "ready" if health.ready else health.why_not_ready, "load": engine.num_in_flight,
                              "kv_block_size": info["cache_config"]["block_size"],
                              "vllm_config": vllm_config(c.model, c.served_model_name, c.max_model_len, info)})

    async def kv_event_sources_(_request: web.Request) -> web.Response:
        return json_response(kv_event_sources(await engine_info()))

    async def get_load(_request: web.Request) -> web.Response:
        # The engine requests this server has running or waiting (vllm-router reads "load").
        return json_response({"load": engine.num_in_flight})

    async def health_generate(_request: web.Request) -> web.Response:
        """200 once a one-token generation has come back: the worker really computes."""
        health.require_ready()
        try:
            async with asyncio.timeout(HEALTH_GENERATE_TIMEOUT_S):
                async for _ in engine.generate(random_id("health"), [0], {"max_tokens": 1, "ignore_eos": True}):
                    pass
        except EngineError as e:
            raise unavailable(f"a one-token generation failed: {e}") from None
        except TimeoutError:
            raise unavailable(f"a one-token generation did not finish within {HEALTH_GENERATE_TIMEOUT_S:g} s") from None
        return web.Response(text="")

    async def flush_cache(_request: web.Request) -> web.Response:
        if not config.dev_mode:
            raise APIError("POST /flush_cache resets the prefix cache, a development endpoint: start the server with "
                           "--dev-mode (as for /reset_prefix_cache)", 403)
        status, text = await scheduler.reset_prefix_cache()
        return web.Response(status=status, text=text)

    return [
        ("POST", "/v1/completions/render", render_completion_),
        ("POST", "/v1/chat/completions/render", render_chat_),
        ("GET", "/get_model_info", model_info),
        ("GET", "/get_server_info", server_info),
        ("GET", "/kv_event_sources", kv_event_sources_),
        ("GET", "/get_load", get_load),
        ("GET", "/health_generate", health_generate),
        ("POST", "/flush_cache", flush_cache),
    ]
