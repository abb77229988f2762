"""The generating routes: ``POST /v1/completions`` and ``/v1/chat/completions``, and
``GET /v1/models``, the card of the one model served. A generation waits for nothing:
until the scheduler was first ready it is a 503 (``SchedulerHealth.require_ready``).

``server_load`` is vLLM's ``server_load_metrics``: the completion and chat requests being
served, counted with ``--enable-server-load-tracking`` (else it stays 0, as vLLM's);
SageMaker's ``/invocations`` comes in through ``completion`` and ``chat`` too."""

from __future__ import annotations

from aiohttp import web

from frontend.engine.scheduler_health import SchedulerHealth
from frontend.http.request_body import read_body
from frontend.openai.serving import ServingContext, json_response, now
from frontend.openai.serving_chat import create_chat_completion
from frontend.openai.serving_completion import create_completion
from frontend.schema.requests import ChatCompletionRequest, CompletionRequest


class GenerateEndpoints:
    def __init__(self, ctx: ServingContext, health: SchedulerHealth):
        self.ctx, self.health = ctx, health
        self.server_load = 0

    async def completion(self, request: web.Request, req: CompletionRequest) -> web.StreamResponse:
        """A decoded completion request served (from /v1/completions or /invocations)."""
        return await self.counted(create_completion, request, req)

    async def chat(self, request: web.Request, req: ChatCompletionRequest) -> web.StreamResponse:
        return await self.counted(create_chat_completion, request, req)

    async def counted(self, create, request: web.Request, req) -> web.StreamResponse:
        tracked = self.ctx.config.enable_server_load_tracking
        self.server_load += tracked
        try:
            self.health.require_ready()
            return await create(self.ctx, request, req)
        finally:
            self.server_load -= tracked

    async def completions_route(self, request: web.Request) -> web.StreamResponse:
        return await self.completion(request, await read_body(request, CompletionRequest))

    async def chat_route(self, request: web.Request) -> web.StreamResponse:
        return await self.chat(request, await read_body(request, ChatCompletionRequest))

    async def models_route(self, _request: web.Request) -> web.Response:
        c = self.ctx.config
        card = {"id": c.served_model_name, "object": "model", "created": now(), "owned_by": "vllm", "root": c.model,
                "parent": None, "max_model_len": c.max_model_len, "permission": []}
        return json_response({"object": "list", "data": [card]})

    def routes(self) -> list[tuple[str, str, object]]:
        return [("POST", "/v1/completions", self.completions_route), ("POST", "/v1/chat/completions", self.chat_route),
                ("GET", "/v1/models", self.models_route)]
