"""The operator routes vLLM's API server has beside the OpenAI ones, as vLLM 0.32
answers them (``vllm/entrypoints/serve/``):

* ``GET /version``: ``{"version": "0.32.0"}``, the vLLM release whose API this is
  (what vLLM clients parse), and kvpool's own under ``kvpool_version``.
* ``GET /load``: ``{"server_load": N}``, the completion and chat requests being
  served; always 0 without ``--enable-server-load-tracking``, as vLLM.
* ``GET|POST /ping`` (SageMaker): ``/health``.
* ``POST /reset_prefix_cache`` (dev mode: ``--dev-mode`` or VLLM_SERVER_DEV_MODE=1):
  ``{"success": bool}``, false while running requests hold blocks.
* ``POST /v1/cache/pin`` / ``/v1/cache/unpin``: pinned prefixes, a kvpool extension
  (``frontend.routes.cache_pins``).
* ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``, only with
  VLLM_ALLOW_RUNTIME_LORA_UPDATING (as vLLM; a 404 otherwise): vLLM's checks of the
  request first (a 400 for an empty name or path, or the served model's name), then,
  kvpool having no LoRA, loading is 501 and unloading finds no adapter (404, vLLM's words).
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
from aiohttp import web

from frontend.config import FrontendConfig
from frontend.engine.scheduler_health import SchedulerHealth
from frontend.engine.scheduler_http import SchedulerHTTP
from frontend.http.request_body import read_body
from frontend.openai.serving import json_response
from frontend.schema.errors import APIError, bad_request
from frontend.version import VLLM_API_VERSION, kvpool_version

# pydantic's spellings of a bool query parameter (vLLM's Query(bool)).
_TRUE = {"1", "on", "t", "true", "y", "yes"}
_FALSE = {"0", "off", "f", "false", "n", "no"}
INVALID_USER_INPUT = "InvalidUserInput"  # vLLM's error type for a LoRA request it refuses unread


class LoadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    lora_name: str


def query_bool(request: web.Request, name: str) -> bool:
    raw = request.query.get(name)
    if raw is None:
        return False
    if raw.lower() in _TRUE | _FALSE:
        return raw.lower() in _TRUE
    raise bad_request(f"query parameter {name} must be a boolean (true or false), got {raw!r}", f"query.{name}")


def ops_routes(config: FrontendConfig, server_load: Callable[[], int], health: SchedulerHealth,
               scheduler: SchedulerHTTP) -> list[tuple[str, str, object]]:

    async def version(_request: web.Request) -> web.Response:
        return json_response({"version": VLLM_API_VERSION, "kvpool_version": kvpool_version()})

    async def load(_request: web.Request) -> web.Response:
        return json_response({"server_load": server_load()})

    async def reset_prefix_cache(request: web.Request) -> web.Response:
        for name in ("reset_running_requests", "reset_external"):
            if query_bool(request, name):
                raise APIError(f"{name}=true is not supported: kvpool's scheduler resets the prefix cache only when "
                               "no running request holds blocks (and has no external cache to reset)", 501)
        status, _text = await scheduler.reset_prefix_cache()
        if status not in (200, 409):  # 409: blocks are held, vLLM's success=false
            raise APIError(f"the scheduler refused to reset its prefix cache ({status}): {_text.strip()}", 503)
        return json_response({"success": status == 200})

    async def load_lora_adapter(request: web.Request) -> web.Response:
        req = await read_body(request, LoadLoRAAdapterRequest)
        # NOTE: vLLM's _check_load_lora_adapter_request, before any loading is tried.
        if not req.lora_name or not req.lora_path:
            raise APIError("Both 'lora_name' and 'lora_path' must be provided.", 400, type_=INVALID_USER_INPUT)
        if req.lora_name == config.served_model_name:
            raise APIError(f"The lora adapter '{req.lora_name}' conflicts with a served base model.", 400, type_=INVALID_USER_INPUT)
        raise APIError(f"cannot load LoRA adapter {req.lora_name!r}: kvpool serves its base model only and has no LoRA "
                       "support (VLLM_ALLOW_RUNTIME_LORA_UPDATING only makes this route exist)", 501)

    async def unload_lora_adapter(request: web.Request) -> web.Response:
        req = await read_body(request, UnloadLoRAAdapterRequest)
        if not req.lora_name:
            raise APIError("'lora_name' needs to be provided to unload a LoRA adapter.", 400, type_=INVALID_USER_INPUT)
        raise APIError(f"The lora adapter '{req.lora_name}' cannot be found.", 404)

    routes = [
        ("GET", "/version", version),
        ("GET", "/load", load),
        ("GET", "/ping", health.health),
        ("POST", "/ping", health.health),
    ]
    if config.dev_mode:
        routes.append(("POST", "/reset_prefix_cache", reset_prefix_cache))
    if config.allow_runtime_lora_updating:
        routes += [("POST", "/v1/load_lora_adapter", load_lora_adapter), ("POST", "/v1/unload_lora_adapter", unload_lora_adapter)]
    return routes
