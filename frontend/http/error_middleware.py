"""The innermost middleware: every failure of a handler answered as OpenAI's error
object (``frontend.schema.errors``), every response counted in the HTTP metrics.

``--log-error-stack`` logs what vLLM's exception handlers log with it: a body that
is not the endpoint's JSON (vLLM's RequestValidationError) with its stack, any other
refusal or failure as one ERROR line; both name the request's id once the endpoint
gave it one (``REQUEST_ID_KEY``), else None. A 404 (no such route or model: vLLM
answers those without raising) and the framework's 405 log nothing there.
"""

from __future__ import annotations

import logging
import time

from aiohttp import web

from frontend.http.request_body import RequestValidationError
from frontend.schema.errors import APIError

log = logging.getLogger("frontend")
REQUEST_ID_KEY = "kvpool_request_id"  # the endpoint's id of the request, once it has one


def error_middleware(metrics, log_error_stack: bool):
    def log_error(request: web.Request, e: Exception) -> None:
        if not log_error_stack or (isinstance(e, APIError) and e.status == 404):
            return
        rid = request.get(REQUEST_ID_KEY)
        if isinstance(e, RequestValidationError):
            log.exception("RequestValidationError caught. Request id: %s", rid)
        else:
            log.error("Exception caught. Request id: %s", rid)

    @web.middleware
    async def middleware(request: web.Request, handler):
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
            log_error(request, e)
            # NOTE: every refusal, with its reason (vLLM's access log gives the status alone).
            log.info('"%s %s" %d: %s', request.method, request.path, status, e.message)
            return e.response()
        except web.HTTPException as e:
            status = e.status
            log.info('"%s %s" %d: %s', request.method, request.path, status, e.reason)
            resp = APIError(e.reason, e.status).response()
            if "Allow" in e.headers:  # a 405 names the methods the route has, as vLLM's
                resp.headers["Allow"] = e.headers["Allow"]
            return resp
        except Exception as e:
            log_error(request, e)
            log.exception("internal error in %s", name)
            return APIError("Internal server error", 500).response()
        finally:
            metrics.http_request(request.method, name, status, time.perf_counter() - start)

    return middleware
