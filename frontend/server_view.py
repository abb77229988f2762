"""What the route modules beside the API server (`cache_pins`, `ops_routes`,
`router_probes`, `sagemaker`) may read and call of it: a Protocol that
`frontend.api_server.APIServer` satisfies. They take a ``ServerView``, so none imports the
server that imports them (no import circle, not even one hidden under TYPE_CHECKING)."""

from __future__ import annotations

from typing import Protocol

from aiohttp import web

from frontend.config import FrontendConfig
from frontend.engine.client import EngineClient
from frontend.schema.requests import ChatCompletionRequest, CompletionRequest
from frontend.openai.serving import ServingContext


class ServerView(Protocol):
    config: FrontendConfig
    ctx: ServingContext
    engine: EngineClient
    # The scheduler's /health as last polled, and why not when it is not 200.
    ready: bool
    why_not_ready: str
    # Completion and chat requests being served (--enable-server-load-tracking).
    server_load: int

    def require_ready(self) -> None: ...

    async def health(self, request: web.Request) -> web.Response: ...

    async def completion(self, request: web.Request, req: CompletionRequest) -> web.StreamResponse: ...

    async def chat(self, request: web.Request, req: ChatCompletionRequest) -> web.StreamResponse: ...

    async def scheduler_engine_info(self) -> dict: ...

    async def scheduler_post(self, path: str, body: bytes) -> tuple[int, bytes]: ...

    async def scheduler_reset_prefix_cache(self) -> tuple[int, str]: ...
