"""The OpenAI-compatible HTTP server (vLLM's ``api_server.py``), on aiohttp.

Routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``
(503 until the scheduler has a worker), ``/tokenize``, ``/detokenize``, ``/metrics``
(the scheduler's and the frontend's); vLLM's operator routes (``frontend.routes.ops``:
``/version``, ``/load``, ``/ping``, dev mode's ``/reset_prefix_cache``, the LoRA
routes) and SageMaker's ``/invocations`` (``frontend.routes.sagemaker``); for vllm-router,
``frontend.routes.router_probes``; vLLM's ``/openapi.json`` and docs pages
(``frontend.routes.openapi``). Every route answers under ``--root-path`` as well. In front
of them, as vLLM stacks its middlewares: the API-key check (``frontend.http.auth``), then
CORS (``frontend.http.cors``). Every failure is OpenAI's error object (``frontend.schema.errors``).
A client that disconnects cancels its handler, which aborts its engine requests.
"""

from __future__ import annotations

import asyncio
import gc
import logging

import aiohttp
from aiohttp import web

from frontend.http.access_log import access_logger_class, configure_server_logging
from frontend.engine.admission import AdmissionControl, RejectionsCollector, merge_rejections
from frontend.http.auth import auth_middleware
from frontend.text.chat_template import load_chat_template
from frontend.config import FrontendConfig
from frontend.http.cors import Cors, install_cors
from frontend.engine.client import EngineClient
from frontend.http.error_middleware import error_middleware
from frontend.schema.errors import bad_request, unavailable
from frontend.http.listen import listen_address, remove_socket, site, socket_inode
from frontend.http.metrics import FrontendMetrics, family_names
from frontend.model_dir import model_vocab_size
from frontend.routes.openapi import docs_routes
from frontend.routes.ops import ops_routes
from frontend.openai.output_log import OutputLog
from frontend.schema.requests import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from frontend.http.request_body import MAX_BODY_KEY, read_body
from frontend.http.request_id import install_request_id_headers
from frontend.routes.router_probes import router_probe_routes
from frontend.routes.sagemaker import invocations_route
from frontend.sampling.params import default_sampling, max_tokens_cap
from frontend.openai.serving import ServingContext, json_response, now
from frontend.openai.serving_chat import chat_prompt, check_generation_prompt, create_chat_completion
from frontend.openai.serving_completion import create_completion
from frontend.http.ssl_refresh import SSLCertRefresher
from frontend.http.tls import ssl_context
from frontend.text.tokenizer import Tokenizer
from frontend.routes.tokenizer_info import tokenizer_info_routes
from frontend.tools.choice import check_tools, template_tools
from frontend.tools.parsers import configured_tool_parser
from frontend.version import system_fingerprint

log = logging.getLogger("frontend")
HEALTH_POLL_S = 0.5


class APIServer:
    def __init__(self, config: FrontendConfig, tokenizer: Tokenizer | None = None):
        self.config = config
        self.tokenizer = tokenizer or Tokenizer(config.model)
        if config.chat_template is not None:
            self.tokenizer.chat_template = load_chat_template(config.chat_template)
            self.tokenizer.chat_template_from_flag = True
        keys = (config.curve_client_key, config.curve_server_key) if config.curve_client_key else None
        self.engine = EngineClient(config.scheduler, keys, AdmissionControl(config.max_num_queued_reqs, config.max_num_queued_tokens),
                                   config.scheduler_restart_timeout_s, self._scheduler_ready)
        self.metrics = FrontendMetrics(config.served_model_name, in_flight=lambda: self.engine.num_in_flight, max_model_len=config.max_model_len)
        defaults = default_sampling(config.generation_config, config.model, config.override_generation_config)
        self.metrics.registry.register(RejectionsCollector(self.engine.admission, config.served_model_name))
        self.ctx = ServingContext(
            config, self.tokenizer, self.engine, self.metrics, defaults,
            max_tokens_cap=max_tokens_cap(config.generation_config, defaults, config.override_generation_config),
            vocab_size=model_vocab_size(config.model),
            tool_parser=configured_tool_parser(config.tool_call_parser, config.enable_auto_tool_choice, self.tokenizer, config.model),
            system_fingerprint=system_fingerprint(config.model, config.served_model_name, config.max_model_len),
            output_log=OutputLog(config.max_log_len, config.enable_log_deltas) if config.enable_log_outputs else None,
        )
        self.ready, self.why_not_ready = False, "the scheduler has not answered yet"
        self.was_ready = False
        # vLLM's server_load_metrics: completion and chat requests being served (with
        # --enable-server-load-tracking; else it stays 0, as vLLM's).
        self.server_load = 0
        self._http: aiohttp.ClientSession | None = None
        self._poller: asyncio.Task | None = None
        self._runner: web.AppRunner | None = None
        self._uds_inode: int | None = None  # the --uds socket file this process bound
        self._ssl_refresher: SSLCertRefresher | None = None

    # --- life cycle -------------------------------------------------------------

    async def start(self) -> None:
        tls = ssl_context(self.config)  # NOTE: first: a bad certificate fails before anything starts
        await self.engine.connect(self.config.connect_timeout_s)
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        # NOTE: one look before listening: a frontend restarted beside a ready scheduler
        # then serves its first connections (queued in kvpool serve's socket) at once.
        await self._check_health()
        self._poller = asyncio.create_task(self._poll_health(), name="frontend-health")
        access = configure_server_logging(self.config)
        self._runner = web.AppRunner(self.build_app(), access_log=access, access_log_class=access_logger_class(self.config),
                                     handler_cancellation=True)
        await self._runner.setup()
        await site(self._runner, self.config, tls).start()
        # NOTE: an inherited socket's file is its owner's (kvpool serve's) to remove.
        self._uds_inode = socket_inode(self.config) if self.config.listen_fd is None else None
        if tls is not None and self.config.enable_ssl_refresh:
            self._ssl_refresher = SSLCertRefresher(tls, self.config)
        # NOTE: as vLLM's API server: what start-up made is never garbage, so the
        # collector's full passes skip it (they ran over the tokenizer and every module).
        gc.collect()
        gc.freeze()

    async def stop(self) -> None:
        if self._ssl_refresher is not None:
            await self._ssl_refresher.stop()
        # NOTE: first, or the runner's clean-up waits on every open response (aiohttp's 60 s).
        self.engine.end_all()
        if self._runner is not None:
            await self._runner.cleanup()
        remove_socket(self.config, self._uds_inode)
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
        if self._http is not None:
            await self._http.close()
        await self.engine.close()

    async def _poll_health(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_POLL_S)
            await self._check_health()

    async def _check_health(self) -> None:
        try:
            async with self._http.get(self.config.scheduler_http + "/health") as r:
                self.ready, self.why_not_ready = r.status == 200, (await r.text()).strip()
                self.was_ready |= self.ready
        except (aiohttp.ClientError, TimeoutError) as e:
            self.ready, self.why_not_ready = False, f"the scheduler's /health is unreachable: {e}"

    async def _scheduler_ready(self) -> bool:
        """One look at the scheduler's /health (the engine client's, after a lost connection)."""
        if self._http is None:
            return False
        await self._check_health()
        return self.ready

    # --- the app ----------------------------------------------------------------

    def build_app(self) -> web.Application:
        c = self.config
        app = web.Application(client_max_size=c.max_request_body_bytes)
        app[MAX_BODY_KEY] = c.max_request_body_bytes
        # NOTE: outermost first, as vLLM's stack: X-Request-Id, the key check, then CORS.
        if c.enable_request_id_headers:
            install_request_id_headers(app)
        auth = [auth_middleware(c.api_key, c.root_path)] if c.api_key else []
        cors = install_cors(app, Cors(c.allowed_origins, c.allowed_methods, c.allowed_headers, c.allow_credentials))
        app.middlewares.extend([*auth, cors, error_middleware(self.metrics, c.log_error_stack)])
        routes = [
            ("POST", "/v1/completions", self._completions),
            ("POST", "/v1/chat/completions", self._chat),
            ("GET", "/v1/models", self._models),
            ("GET", "/health", self.health),
            ("POST", "/tokenize", self._tokenize),
            ("POST", "/detokenize", self._detokenize),
            ("GET", "/metrics", self._metrics),
            invocations_route(self),
            *ops_routes(self),
            *router_probe_routes(self),
            *tokenizer_info_routes(self),
        ]
        if not c.disable_fastapi_docs:
            routes += docs_routes(routes, c.root_path)
        # NOTE: as Starlette's root_path: a route answers with the prefix and without it.
        for prefix in ("", c.root_path) if c.root_path else ("",):
            for method, path, handler in routes:
                app.router.add_route(method, prefix + path, handler)
        return app

    def require_ready(self) -> None:
        # NOTE: only until the scheduler was first ready. After that a missing worker
        # is a restart: the scheduler queues new requests until one is back (or its
        # --worker-reconnect-timeout passes), so they must reach it.
        if not self.ready and not self.was_ready:
            raise unavailable(f"The server is not ready: {self.why_not_ready}")

    async def completion(self, request: web.Request, req: CompletionRequest) -> web.StreamResponse:
        """A decoded completion request served (from /v1/completions or /invocations)."""
        return await self._counted(create_completion, request, req)

    async def chat(self, request: web.Request, req: ChatCompletionRequest) -> web.StreamResponse:
        return await self._counted(create_chat_completion, request, req)

    async def _counted(self, create, request, req) -> web.StreamResponse:
        tracked = self.config.enable_server_load_tracking
        self.server_load += tracked
        try:
            self.require_ready()
            return await create(self.ctx, request, req)
        finally:
            self.server_load -= tracked

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self.completion(request, await read_body(request, CompletionRequest))

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self.chat(request, await read_body(request, ChatCompletionRequest))

    async def _models(self, _request: web.Request) -> web.Response:
        card = {"id": self.ctx.config.served_model_name, "object": "model", "created": now(), "owned_by": "vllm", "root": self.ctx.config.model,
                "parent": None, "max_model_len": self.ctx.config.max_model_len, "permission": []}
        return json_response({"object": "list", "data": [card]})

    async def health(self, _request: web.Request) -> web.Response:
        return web.Response(status=200 if self.ready else 503, text="" if self.ready else self.why_not_ready + "\n")

    async def _tokenize(self, request: web.Request) -> web.Response:
        req = await read_body(request, TokenizeRequest)
        self.ctx.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt and messages", "prompt")
        if req.prompt is not None:
            add = True if req.add_special_tokens is None else req.add_special_tokens
            ids = await self.tokenizer.encode_async(req.prompt, add_special_tokens=add)
        else:
            check_generation_prompt(req)
            check_tools(req.tools)
            ids, _ = await chat_prompt(self.ctx, req.messages, req.add_generation_prompt, bool(req.add_special_tokens),
                                       template_tools(req.tools),
                                       chat_template_kwargs=req.chat_template_kwargs, continue_final_message=req.continue_final_message,
                                       chat_template=req.chat_template)
        strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return json_response({"count": len(ids), "max_model_len": self.ctx.config.max_model_len, "tokens": ids, "token_strs": strs})

    async def _detokenize(self, request: web.Request) -> web.Response:
        req = await read_body(request, DetokenizeRequest)
        self.ctx.check_model(req.model)
        self.ctx.check_token_ids(req.tokens, "tokens")
        # NOTE: vLLM's transformers decode, whose default keeps the special tokens
        return json_response({"prompt": await self.tokenizer.decode_async(req.tokens, skip_special_tokens=False)})

    async def _metrics(self, _request: web.Request) -> web.Response:
        scheduler = b""
        try:
            async with self._http.get(self.config.scheduler_http + "/metrics") as r:
                if r.status == 200:
                    scheduler = await r.read()
        except (aiohttp.ClientError, TimeoutError) as e:
            log.warning("scheduler /metrics unreachable: %s", e)
        # NOTE: vllm:admission_rejections once: the frontend's counts go into the scheduler's lines (frontend/engine/admission.py).
        scheduler = merge_rejections(scheduler, self.engine.admission.rejections)
        return web.Response(body=scheduler + self.metrics.render(family_names(scheduler)), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def scheduler_engine_info(self) -> dict:
        """The scheduler's GET /engine_info (scheduler/engine/engine_info.py); 503 when unreachable."""
        try:
            async with self._http.get(self.config.scheduler_http + "/engine_info") as r:
                if r.status == 200:
                    return await r.json()
                raise unavailable(f"the scheduler's /engine_info answered {r.status}")
        except (aiohttp.ClientError, TimeoutError) as e:
            raise unavailable(f"the scheduler is unreachable: {e}") from None

    async def scheduler_post(self, path: str, body: bytes) -> tuple[int, bytes]:
        """POST ``body`` (JSON) to the scheduler's HTTP ``path``: (status, its body)."""
        try:
            async with self._http.post(self.config.scheduler_http + path, data=body, headers={"Content-Type": "application/json"}) as r:
                return r.status, await r.read()
        except (aiohttp.ClientError, TimeoutError) as e:
            raise unavailable(f"the scheduler is unreachable: {e}") from None

    async def scheduler_reset_prefix_cache(self) -> tuple[int, str]:
        """The scheduler's answer to POST /reset_prefix_cache: (status, its text)."""
        try:
            async with self._http.post(self.config.scheduler_http + "/reset_prefix_cache") as r:
                return r.status, await r.text()
        except (aiohttp.ClientError, TimeoutError) as e:
            raise unavailable(f"the scheduler is unreachable: {e}") from None


async def serve(config: FrontendConfig, stop: asyncio.Event) -> int:
    server = None
    try:
        server = APIServer(config)
        # NOTE: a stop while start-up still waits for the scheduler (up to
        # --connect-timeout) ends it at once, not once the wait is over.
        starting = asyncio.ensure_future(server.start())
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            await server.stop()
            return 0
        stopped.cancel()
        starting.result()
    except Exception as e:  # noqa: BLE001 - a port in use, no scheduler, a bad certificate or template: say which
        log.error("cannot start: %s", e)
        if server is not None:
            await server.stop()
        return 1
    log.info("serving %s on %s", config.served_model_name, listen_address(config))
    await stop.wait()
    await server.stop()
    return 0
