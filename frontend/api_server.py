"""The OpenAI-compatible HTTP server (vLLM's ``api_server.py``), on aiohttp.

Routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``
(503 until the scheduler has a worker), ``/version``, ``/tokenize``,
``/detokenize``, ``/metrics`` (the scheduler's and the frontend's), and in dev mode
``/reset_prefix_cache``; for vllm-router, the render endpoints (``frontend.render``),
``/get_model_info``, ``/get_server_info``, ``/get_load``, ``/health_generate`` and
``/flush_cache`` (dev mode). Every failure is OpenAI's error object (``frontend.errors``).
A client that disconnects cancels its handler, which aborts its engine requests.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from importlib.metadata import PackageNotFoundError, version

import aiohttp
import msgspec
from aiohttp import web

from frontend.config import FrontendConfig
from frontend.engine_client import EngineClient, EngineError
from frontend.errors import APIError, bad_request, unavailable
from frontend.metrics import FrontendMetrics, family_names
from frontend.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from frontend.render import render_chat, render_completion
from frontend.sampling import default_sampling
from frontend.serving import ServingContext, json_response, now, random_id
from frontend.serving_chat import chat_prompt, create_chat_completion
from frontend.serving_completion import create_completion
from frontend.tokenizer import Tokenizer

log = logging.getLogger("frontend")
HEALTH_POLL_S = 0.5
# GET /health_generate: the most a one-token generation may take before it is a failure.
HEALTH_GENERATE_TIMEOUT_S = 30.0


def kvpool_version() -> str:
    try:
        return version("kvpool")
    except PackageNotFoundError:  # pragma: no cover - run from a source tree
        return "0.0.0"


async def read_body(request: web.Request, type_):
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        limit = request.app["max_request_body_bytes"]
        raise APIError(f"Request body too large: over the limit of {limit} bytes (--max-request-body-bytes).", 413) from None
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as e:
        raise bad_request(f"Invalid request: {e}") from None
    except msgspec.DecodeError as e:
        raise bad_request(f"JSON decode error: {e}") from None


class APIServer:
    def __init__(self, config: FrontendConfig, tokenizer: Tokenizer | None = None):
        self.config = config
        self.tokenizer = tokenizer or Tokenizer(config.model)
        keys = (config.curve_client_key, config.curve_server_key) if config.curve_client_key else None
        self.engine = EngineClient(config.scheduler, keys)
        self.metrics = FrontendMetrics(config.served_model_name, in_flight=lambda: self.engine.num_in_flight, max_model_len=config.max_model_len)
        self.ctx = ServingContext(
            config.served_model_name, config.model, config.max_model_len, self.tokenizer, self.engine, self.metrics,
            default_sampling(config.generation_config, config.model), config.return_tokens_as_token_ids,
            log_requests=config.enable_log_requests, max_n=config.max_n_sequences,
        )  # fmt: skip
        self.ready, self.why_not_ready = False, "the scheduler has not answered yet"
        self.was_ready = False
        self._http: aiohttp.ClientSession | None = None
        self._poller: asyncio.Task | None = None
        self._runner: web.AppRunner | None = None

    # --- life cycle -------------------------------------------------------------

    async def start(self) -> None:
        await self.engine.connect(self.config.connect_timeout_s)
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        self._poller = asyncio.create_task(self._poll_health(), name="frontend-health")
        self._runner = web.AppRunner(self.build_app(), access_log=None, handler_cancellation=True)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.config.host, self.config.port).start()
        # NOTE: as vLLM's API server: what start-up made is never garbage, so the
        # collector's full passes skip it (they ran over the tokenizer and every module).
        gc.collect()
        gc.freeze()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
        if self._http is not None:
            await self._http.close()
        await self.engine.close()

    async def _poll_health(self) -> None:
        url = self.config.scheduler_http + "/health"
        while True:
            try:
                async with self._http.get(url) as r:
                    self.ready, self.why_not_ready = r.status == 200, (await r.text()).strip()
                    self.was_ready |= self.ready
            except (aiohttp.ClientError, TimeoutError) as e:
                self.ready, self.why_not_ready = False, f"the scheduler's /health is unreachable: {e}"
            await asyncio.sleep(HEALTH_POLL_S)

    # --- the app ----------------------------------------------------------------

    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_request_body_bytes, middlewares=[self._middleware])
        app["max_request_body_bytes"] = self.config.max_request_body_bytes
        r = app.router
        r.add_post("/v1/completions", self._completions)
        r.add_post("/v1/chat/completions", self._chat)
        r.add_get("/v1/models", self._models)
        r.add_get("/health", self._health)
        r.add_get("/version", self._version)
        r.add_post("/tokenize", self._tokenize)
        r.add_post("/detokenize", self._detokenize)
        r.add_get("/metrics", self._metrics)
        if self.config.dev_mode:
            r.add_post("/reset_prefix_cache", self._reset_prefix_cache)
        # What vllm-router probes besides the routes above (SGLang's names; docs/architecture.md).
        r.add_post("/v1/completions/render", self._render_completion)
        r.add_post("/v1/chat/completions/render", self._render_chat)
        r.add_get("/get_model_info", self._model_info)
        r.add_get("/get_server_info", self._server_info)
        r.add_get("/get_load", self._load)
        r.add_get("/health_generate", self._health_generate)
        r.add_post("/flush_cache", self._flush_cache)
        return app

    @web.middleware
    async def _middleware(self, request: web.Request, handler):
        start = time.perf_counter()
        route = request.match_info.route.resource
        name = route.canonical if route is not None else "none"
        status = 500
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        except APIError as e:
            status = e.status.value
            # NOTE: every refusal, with its reason (vLLM's access log gives the status alone).
            log.info('"%s %s" %d: %s', request.method, request.path, status, e.message)
            return e.response()
        except web.HTTPException as e:
            status = e.status
            log.info('"%s %s" %d: %s', request.method, request.path, status, e.reason)
            return APIError(e.reason, e.status).response()
        except Exception:
            log.exception("internal error in %s", name)
            return APIError("Internal server error", 500).response()
        finally:
            self.metrics.http_request(request.method, name, status, time.perf_counter() - start)

    def _require_ready(self) -> None:
        # NOTE: only until the scheduler was first ready. After that a missing worker
        # is a restart: the scheduler queues new requests until one is back (or its
        # --worker-reconnect-timeout passes), so they must reach it.
        if not self.ready and not self.was_ready:
            raise unavailable(f"The server is not ready: {self.why_not_ready}")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        req = await read_body(request, CompletionRequest)
        self._require_ready()
        return await create_completion(self.ctx, request, req)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        req = await read_body(request, ChatCompletionRequest)
        self._require_ready()
        return await create_chat_completion(self.ctx, request, req)

    async def _models(self, _request: web.Request) -> web.Response:
        card = {"id": self.ctx.model_name, "object": "model", "created": now(), "owned_by": "vllm", "root": self.ctx.model_path,
                "parent": None, "max_model_len": self.ctx.max_model_len, "permission": []}  # fmt: skip
        return json_response({"object": "list", "data": [card]})

    async def _health(self, _request: web.Request) -> web.Response:
        return web.Response(status=200 if self.ready else 503, text="" if self.ready else self.why_not_ready + "\n")

    async def _version(self, _request: web.Request) -> web.Response:
        return json_response({"version": kvpool_version()})

    async def _tokenize(self, request: web.Request) -> web.Response:
        req = await read_body(request, TokenizeRequest)
        self.ctx.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt and messages", "prompt")
        if req.prompt is not None:
            add = True if req.add_special_tokens is None else req.add_special_tokens
            ids = self.tokenizer.encode(req.prompt, add_special_tokens=add)
        else:
            ids = chat_prompt(self.ctx, req.messages, req.add_generation_prompt, bool(req.add_special_tokens))
        strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return json_response({"count": len(ids), "max_model_len": self.ctx.max_model_len, "tokens": ids, "token_strs": strs})

    async def _detokenize(self, request: web.Request) -> web.Response:
        req = await read_body(request, DetokenizeRequest)
        self.ctx.check_model(req.model)
        self.ctx.check_token_ids(req.tokens, "tokens")
        return json_response({"prompt": self.tokenizer.decode(req.tokens)})

    async def _metrics(self, _request: web.Request) -> web.Response:
        scheduler = b""
        try:
            async with self._http.get(self.config.scheduler_http + "/metrics") as r:
                if r.status == 200:
                    scheduler = await r.read()
        except (aiohttp.ClientError, TimeoutError) as e:
            log.warning("scheduler /metrics unreachable: %s", e)
        return web.Response(body=scheduler + self.metrics.render(family_names(scheduler)), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def _reset_prefix_cache(self, _request: web.Request) -> web.Response:
        try:
            async with self._http.post(self.config.scheduler_http + "/reset_prefix_cache") as r:
                return web.Response(status=r.status, text=await r.text())
        except (aiohttp.ClientError, TimeoutError) as e:
            raise unavailable(f"the scheduler is unreachable: {e}") from None

    # --- what a router probes ---------------------------------------------------------

    async def _render_completion(self, request: web.Request) -> web.Response:
        return web.Response(body=msgspec.json.encode(render_completion(self.ctx, await read_body(request, CompletionRequest))),
                            content_type="application/json")  # fmt: skip

    async def _render_chat(self, request: web.Request) -> web.Response:
        return json_response(render_chat(self.ctx, await read_body(request, ChatCompletionRequest)))

    async def _model_info(self, _request: web.Request) -> web.Response:
        return json_response({"model_path": self.ctx.model_path, "tokenizer_path": self.ctx.model_path, "is_generation": True,
                              "served_model_name": self.ctx.model_name, "max_model_len": self.ctx.max_model_len})  # fmt: skip

    async def _server_info(self, _request: web.Request) -> web.Response:
        c = self.config
        return json_response({"version": kvpool_version(), "model_path": c.model, "served_model_name": c.served_model_name,
                              "max_model_len": c.max_model_len, "dev_mode": c.dev_mode, "ready": self.ready,
                              "status": "ready" if self.ready else self.why_not_ready, "load": self.engine.num_in_flight})  # fmt: skip

    async def _load(self, _request: web.Request) -> web.Response:
        # The engine requests this server has running or waiting (vllm-router reads "load").
        return json_response({"load": self.engine.num_in_flight})

    async def _health_generate(self, _request: web.Request) -> web.Response:
        """200 once a one-token generation has come back: the worker really computes."""
        self._require_ready()
        try:
            async with asyncio.timeout(HEALTH_GENERATE_TIMEOUT_S):
                async for _ in self.engine.generate(random_id("health"), [0], {"max_tokens": 1, "ignore_eos": True}):
                    pass
        except EngineError as e:
            raise unavailable(f"a one-token generation failed: {e}") from None
        except TimeoutError:
            raise unavailable(f"a one-token generation did not finish within {HEALTH_GENERATE_TIMEOUT_S:g} s") from None
        return web.Response(text="")

    async def _flush_cache(self, request: web.Request) -> web.Response:
        if not self.config.dev_mode:
            raise APIError("POST /flush_cache resets the prefix cache, a development endpoint: start the server with "
                           "--dev-mode (as for /reset_prefix_cache)", 403)  # fmt: skip
        return await self._reset_prefix_cache(request)


async def serve(config: FrontendConfig, stop: asyncio.Event) -> int:
    server = APIServer(config)
    try:
        await server.start()
    except Exception as e:  # noqa: BLE001 - a port in use, no scheduler: say which
        log.error("cannot start: %s", e)
        await server.stop()
        return 1
    log.info("serving %s on http://%s:%d", config.served_model_name, config.host, config.port)
    await stop.wait()
    await server.stop()
    return 0
