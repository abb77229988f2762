"""The settings table's rows of vLLM's Frontend group that shape the API server's HTTP
side: its socket, keys, CORS, TLS, access log and documentation pages. ``kvpool serve``
passes each to the API server as given (frontend/serve/flags/frontend_args.py)."""

from __future__ import annotations

import argparse
import json

from protocol.serve_flags.flag import FRONTEND, flag

# NOTE: the API server's names for uvicorn's levels (frontend/config.py, checked equal by
# tests/frontend/test_config_rows.py).
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")

ON_OFF = argparse.BooleanOptionalAction

UDS = flag("--uds", FRONTEND, default=None, help="listen on this Unix domain socket instead of --host and --port (default: none)")
API_KEY = flag("--api-key", FRONTEND, nargs="+", default=None,
               help="keys of which /v1/* requires one as `Authorization: Bearer KEY` (default: VLLM_API_KEY, else none)")
ALLOWED_ORIGINS = flag("--allowed-origins", FRONTEND, type=json.loads, default=[], help="CORS origins, a JSON list (default %(default)s: none)")
ALLOWED_METHODS = flag("--allowed-methods", FRONTEND, type=json.loads, default=["*"], help="CORS methods, a JSON list (default %(default)s)")
ALLOWED_HEADERS = flag("--allowed-headers", FRONTEND, type=json.loads, default=["*"], help="CORS headers, a JSON list (default %(default)s)")
ALLOW_CREDENTIALS = flag("--allow-credentials", FRONTEND, action=ON_OFF, default=False, help="CORS credentials (default %(default)s)")
SSL_KEYFILE = flag("--ssl-keyfile", FRONTEND, default=None, help="serve HTTPS with this key (default: none)")
SSL_CERTFILE = flag("--ssl-certfile", FRONTEND, default=None, help="serve HTTPS with this certificate chain (default: none, plain HTTP)")
SSL_CA_CERTS = flag("--ssl-ca-certs", FRONTEND, default=None, help="CA certificates to verify clients with (default: none)")
SSL_CERT_REQS = flag("--ssl-cert-reqs", FRONTEND, type=int, default=0,
                     help="client certificates: 0 none, 1 optional, 2 required, as ssl.CERT_* (default %(default)s)")
ENABLE_SSL_REFRESH = flag("--enable-ssl-refresh", FRONTEND, action=ON_OFF, default=False,
                          help="reload the key, certificate and CA files when they change (default %(default)s)")
SSL_CIPHERS = flag("--ssl-ciphers", FRONTEND, default=None,
                   help="OpenSSL cipher suites for TLS 1.2 and below, e.g. ECDHE-RSA-AES256-GCM-SHA384 (default: OpenSSL's)")
UVICORN_LOG_LEVEL = flag("--uvicorn-log-level", FRONTEND, default="info", choices=UVICORN_LOG_LEVELS,
                         help="the HTTP server's own loggers and the access log (default %(default)s)")
DISABLE_UVICORN_ACCESS_LOG = flag("--disable-uvicorn-access-log", FRONTEND, action=ON_OFF, default=False,
                                  help="no line per request (default %(default)s)")
DISABLE_ACCESS_LOG_FOR_ENDPOINTS = flag("--disable-access-log-for-endpoints", FRONTEND, default=None,
                                        help='paths the access log leaves out, comma-separated: "/health,/metrics" (default: none)')
DISABLE_FASTAPI_DOCS = flag("--disable-fastapi-docs", FRONTEND, action=ON_OFF, default=False,
                            help="no /openapi.json, /docs nor /redoc (default %(default)s)")
ROOT_PATH = flag("--root-path", FRONTEND, default=None,
                 help="a path prefix every route answers under as well, behind a proxy (default: none)")
ENABLE_SERVER_LOAD_TRACKING = flag("--enable-server-load-tracking", FRONTEND, action=ON_OFF, default=False,
                                   help="/load counts the requests being served (default %(default)s: 0)")
ENABLE_REQUEST_ID_HEADERS = flag("--enable-request-id-headers", FRONTEND, action=ON_OFF, default=False,
                                 help="X-Request-Id on every response (default %(default)s)")
ENABLE_TOKENIZER_INFO_ENDPOINT = flag("--enable-tokenizer-info-endpoint", FRONTEND, action=ON_OFF, default=False,
                                      help="serve GET /tokenizer_info (default %(default)s)")
SSE_KEEP_ALIVE_INTERVAL = flag("--sse-keep-alive-interval", FRONTEND, type=int, default=0,
                               help='a stream silent this many seconds gets a ": keep-alive" comment (default %(default)s: never)')

ROWS = (UDS, API_KEY, ALLOWED_ORIGINS, ALLOWED_METHODS, ALLOWED_HEADERS, ALLOW_CREDENTIALS, SSL_KEYFILE, SSL_CERTFILE, SSL_CA_CERTS,
        SSL_CERT_REQS, ENABLE_SSL_REFRESH, SSL_CIPHERS, UVICORN_LOG_LEVEL, DISABLE_UVICORN_ACCESS_LOG, DISABLE_ACCESS_LOG_FOR_ENDPOINTS,
        DISABLE_FASTAPI_DOCS, ROOT_PATH, ENABLE_SERVER_LOAD_TRACKING, ENABLE_REQUEST_ID_HEADERS, ENABLE_TOKENIZER_INFO_ENDPOINT,
        SSE_KEEP_ALIVE_INTERVAL)
