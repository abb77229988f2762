"""The HTTP server's own logging, as vLLM's uvicorn does it.

One access line per response (uvicorn's: ``127.0.0.1:40112 - "POST /v1/completions
HTTP/1.1" 200 OK``) on the ``frontend.access`` logger, unless
``--disable-uvicorn-access-log``. ``--uvicorn-log-level`` sets the level of that
logger and of aiohttp's own (``aiohttp.*``: connection and protocol errors), as
uvicorn sets ``uvicorn.error`` / ``uvicorn.access``; the rest of the process logs at
``--log-level``. aiohttp logs the line when the response is done, uvicorn as its
headers go out: the line is the same. ``--disable-access-log-for-endpoints
/health,/metrics`` leaves out the lines of those paths (each matched whole, the
query string aside), as vLLM's ``UvicornAccessLogFilter``.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

from frontend.config import FrontendConfig, server_log_level

ACCESS_LOGGER = "frontend.access"
_SERVER_LOGGERS = ("aiohttp", ACCESS_LOGGER)


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""


def excluded_paths(endpoints: str | None) -> frozenset[str]:
    """--disable-access-log-for-endpoints, read as vLLM reads it: comma-separated, blanks dropped."""
    return frozenset(p.strip() for p in (endpoints or "").split(",") if p.strip())


class UvicornAccessLogger(AbstractAccessLogger):
    excluded: frozenset[str] = frozenset()  # NOTE: set per server by `access_logger_class`

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        if request.path in self.excluded:
            return
        peer = request.transport.get_extra_info("peername") if request.transport is not None else None
        client = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else "-"
        v = request.version
        self.logger.info('%s - "%s %s HTTP/%d.%d" %d %s', client, request.method, request.path_qs, v.major, v.minor,
                         response.status, _phrase(response.status))

    @property
    def enabled(self) -> bool:
        return self.logger.isEnabledFor(logging.INFO)


def configure_server_logging(config: FrontendConfig) -> logging.Logger | None:
    """Set the server loggers' level; the access logger, or None when it is off."""
    logging.addLevelName(5, "TRACE")
    level = server_log_level(config.uvicorn_log_level)
    for name in _SERVER_LOGGERS:
        logging.getLogger(name).setLevel(level)
    return None if config.disable_uvicorn_access_log else logging.getLogger(ACCESS_LOGGER)


def access_logger_class(config: FrontendConfig) -> type[UvicornAccessLogger]:
    """aiohttp takes the access logger as a class: one per server, its paths left out."""
    return type("UvicornAccessLogger", (UvicornAccessLogger,), {"excluded": excluded_paths(config.disable_access_log_for_endpoints)})
