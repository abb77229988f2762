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

from aiohttp import web

from frontend.config import FrontendConfig
from frontend.engine.admission import AdmissionControl, RejectionsCollector
from frontend.engine.client import EngineClient
from frontend.engine.scheduler_health import SchedulerHealth
from frontend.engine.scheduler_http import SchedulerHTTP
from frontend.http.access_log import access_logger_class, configure_server_logging
from frontend.http.auth import auth_middleware
from frontend.http.cors import Cors, install_cors
from frontend.http.error_middleware import error_middleware
from frontend.http.listen import listen_address, remove_socket, site, socket_inode
from frontend.http.metrics import FrontendMetrics
from frontend.http.request_body import MAX_BODY_KEY
from frontend.http.request_id import install_request_id_headers
from frontend.http.ssl_refresh import SSLCertRefresher
from frontend.http.tls import ssl_context
from frontend.openai.output_log import OutputLog
from frontend.openai.serving import ServingContext
from frontend.routes.cache_pins import cache_pin_routes
from frontend.routes.generate import GenerateEndpoints
from frontend.routes.metrics import metrics_route
from frontend.routes.openapi import docs_routes
from frontend.routes.ops import ops_routes
from frontend.routes.router_probes import router_probe_routes
from frontend.routes.sagemaker import invocations_route
from frontend.routes.tokenize import tokenize_routes
from frontend.routes.tokenizer_info import tokenizer_info_routes
from frontend.sampling.params import default_sampling, max_tokens_cap
from frontend.serve.model_dir import model_vocab_size
from frontend.text.chat_template import load_chat_template
from frontend.text.tokenizer import Tokenizer
from frontend.tools.parsers import configured_tool_parser
from frontend.version import system_fingerprint

log = logging.getLogger("frontend")


def serving_context(config: FrontendConfig, tokenizer: Tokenizer, engine: EngineClient, metrics: FrontendMetrics) -> ServingContext:
    """What the handlers share, built once from the flags."""
    defaults = default_sampling(config.generation_config, config.model, config.override_generation_config)
    return ServingContext(
        config, tokenizer, engine, metrics, defaults,
        max_tokens_cap=max_tokens_cap(config.generation_config, defaults, config.override_generation_config),
        vocab_size=model_vocab_size(config.model),
        tool_parser=configured_tool_parser(config.tool_call_parser, config.enable_auto_tool_choice, tokenizer, config.model),
        system_fingerprint=system_fingerprint(config.model, config.served_model_name, config.max_model_len),
        output_log=OutputLog(config.max_log_len, config.enable_log_deltas) if config.enable_log_outputs else None,
    )


class APIServer:
    def __init__(self, config: FrontendConfig, tokenizer: Tokenizer | None = None):
        self.config = config
        self.tokenizer = tokenizer or Tokenizer(config.model)
        if config.chat_template is not None:
            self.tokenizer.chat_template = load_chat_template(config.chat_template)
            self.tokenizer.chat_template_from_flag = True
        self.scheduler = SchedulerHTTP(config.scheduler_http)
        self.health = SchedulerHealth(self.scheduler)
        keys = (config.curve_client_key, config.curve_server_key) if config.curve_client_key else None
        self.engine = EngineClient(config.scheduler, keys, AdmissionControl(config.max_num_queued_reqs, config.max_num_queued_tokens),
                                   config.scheduler_restart_timeout_s, self.health.check)
        self.metrics = FrontendMetrics(config.served_model_name, in_flight=lambda: self.engine.num_in_flight, max_model_len=config.max_model_len)
        self.metrics.registry.register(RejectionsCollector(self.engine.admission, config.served_model_name))
        self.ctx = serving_context(config, self.tokenizer, self.engine, self.metrics)
        self.generate = GenerateEndpoints(self.ctx, self.health)
        self._poller: asyncio.Task | None = None
        self._runner: web.AppRunner | None = None
        self._uds_inode: int | None = None  # the --uds socket file this process bound
        self._ssl_refresher: SSLCertRefresher | None = None

    # --- life cycle -------------------------------------------------------------

    async def start(self) -> None:
        tls = ssl_context(self.config)  # NOTE: first: a bad certificate fails before anything starts
        await self.engine.connect(self.config.connect_timeout_s)
        await self.scheduler.open()
        # NOTE: one look before listening: a frontend restarted beside a ready scheduler
        # then serves its first connections (queued in kvpool serve's socket) at once.
        await self.health.check()
        self._poller = asyncio.create_task(self.health.poll(), name="frontend-health")
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
        await self.scheduler.close()
        await self.engine.close()

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
            *self.generate.routes(),
            ("GET", "/health", self.health.health),
            *tokenize_routes(self.ctx),
            metrics_route(self.metrics, self.scheduler, self.engine.admission),
            invocations_route(self.generate.completion, self.generate.chat),
            *ops_routes(c, lambda: self.generate.server_load, self.health, self.scheduler),
            *cache_pin_routes(self.ctx, self.scheduler),
            *router_probe_routes(self.ctx, self.health, self.scheduler),
            *tokenizer_info_routes(c.enable_tokenizer_info_endpoint, c.model, self.tokenizer),
        ]
        if not c.disable_fastapi_docs:
            routes += docs_routes(routes, c.root_path)
        # NOTE: as Starlette's root_path: a route answers with the prefix and without it.
        for prefix in ("", c.root_path) if c.root_path else ("",):
            for method, path, handler in routes:
                app.router.add_route(method, prefix + path, handler)
        return app


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
