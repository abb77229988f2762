"""The frontend process's one frozen config, built from the command line
(``python -m frontend``; ``kvpool serve`` passes these for you). Flags as
``vllm serve`` names them where it has them."""

from __future__ import annotations

import argparse
import json
import os
import ssl
from dataclasses import dataclass

from frontend.engine.admission import add_admission_args, check_admission_args
from frontend.sampling.params import DEFAULT_MAX_N_SEQUENCES
from frontend.text.chat_template import chat_template_problem
from frontend.tools.parsers import TOOL_PARSERS
from protocol.kv_transfer_config import KVTransferConfig, parse_kv_transfer_config
from protocol.sampling_params import MAX_LOGPROBS
from protocol.serve_flags import FRONTEND, rows_for
from protocol.serve_flags.flag import add_flag, unaccepted
from protocol.serve_flags.model import one_name


@dataclass(frozen=True, slots=True)
class FrontendConfig:
    model: str
    served_model_name: str
    host: str = "127.0.0.1"
    # NOTE: not vLLM's 8000: on their own, the scheduler's HTTP port is 8000 and the
    # worker's 8001 (`kvpool serve` puts the API on 8000 and picks the others free).
    port: int = 8002
    uds: str | None = None  # a Unix domain socket to listen on instead of host:port (frontend.http.listen)
    # A listening socket already bound to host:port, inherited (kvpool serve's, so that
    # connections made while the frontend restarts wait in its backlog, not refused).
    listen_fd: int | None = None
    scheduler: str = "tcp://127.0.0.1:5555"
    scheduler_http: str = "http://127.0.0.1:8000"
    max_model_len: int = 4096
    generation_config: str = "auto"
    return_tokens_as_token_ids: bool = False
    dev_mode: bool = False
    # NOTE: aiohttp refuses a larger body with 413 before reading it; 4 MiB is far
    # more text than --max-model-len tokens of any tokenizer.
    max_request_body_bytes: int = 4 << 20
    connect_timeout_s: float = 60.0
    # A lost scheduler (restarting): requests in flight and new ones wait this long for it
    # to be ready again, then resume there (frontend/engine/client.py); 0: fail them at once.
    scheduler_restart_timeout_s: float = 30.0
    curve_client_key: str | None = None
    curve_server_key: str | None = None
    log_level: str = "INFO"
    enable_log_requests: bool = False
    # vLLM's VLLM_MAX_N_SEQUENCES, read as vLLM reads it: the most choices one request may ask for.
    max_n_sequences: int = DEFAULT_MAX_N_SEQUENCES
    # vLLM's queue limits, enforced here as in vLLM's API server (frontend/engine/admission.py); None: none.
    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None
    # --- vLLM's operator flags (vllm/entrypoints/launchers/cli_args.py), its names ---
    # --api-key KEY [KEY ...], else VLLM_API_KEY: the keys /v1/* requires (frontend.http.auth).
    api_key: tuple[str, ...] = ()
    # CORS (frontend.http.cors): no origin is allowed unless given, as vLLM 0.32.
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    # TLS (frontend.http.tls), as uvicorn builds its context.
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = int(ssl.CERT_NONE)
    enable_ssl_refresh: bool = False  # reload the files into the context when they change (frontend.http.ssl_refresh)
    ssl_ciphers: str | None = None  # OpenSSL cipher list (TLS 1.2 and below), as uvicorn's ctx.set_ciphers
    enable_prompt_tokens_details: bool = False
    max_logprobs: int = 20
    uvicorn_log_level: str = "info"
    disable_uvicorn_access_log: bool = False
    disable_fastapi_docs: bool = False
    root_path: str | None = None
    chat_template: str | None = None
    chat_template_content_format: str = "auto"  # "string", "openai", or auto: frontend.text.content_format
    response_role: str = "assistant"
    enable_server_load_tracking: bool = False
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING: the LoRA routes exist (and refuse: no LoRA here).
    allow_runtime_lora_updating: bool = False
    # --- vLLM's Frontend flags of its serving classes (vllm/entrypoints/launchers/cli_args.py) ---
    enable_request_id_headers: bool = False  # X-Request-Id on every response (frontend.http.request_id)
    enable_force_include_usage: bool = False  # usage in every stream, continuous too
    override_generation_config: dict | None = None  # merged over --generation-config's defaults
    default_chat_template_kwargs: dict | None = None  # under each request's chat_template_kwargs
    trust_request_chat_template: bool = False  # a request may bring its own chat_template
    disable_access_log_for_endpoints: str | None = None  # comma-separated paths the access log leaves out
    enable_log_outputs: bool = False  # with --enable-log-requests: each chat output (frontend.openai.output_log)
    enable_log_deltas: bool = True  # with --enable-log-outputs: each streamed delta too
    max_log_len: int | None = None  # output text logged cut to this many characters
    enable_tokenizer_info_endpoint: bool = False  # GET /tokenizer_info (frontend.routes.tokenizer_info)
    log_error_stack: bool = False  # an error response logs its stack; default VLLM_SERVER_DEV_MODE
    sse_keep_alive_interval: int = 0  # s of stream silence before a ": keep-alive" comment (0: never)
    # Tool calls (frontend.tools.choice): parsed from the model's text only with both, as vLLM.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    enforce_strict_tool_calling: bool = True  # VLLM_ENFORCE_STRICT_TOOL_CALLING, read as vLLM reads it
    tool_strict_level: str = "auto"  # the structural tag's floor: auto, function or parameter
    exclude_tools_when_tool_choice_none: bool = False  # tool_choice "none": the template sees no tools
    # --kv-transfer-config (protocol.kv_transfer_config): a KV connector, so requests'
    # kv_transfer_params are checked and sent to the engine; None: ignored, as vLLM.
    kv_transfer_config: KVTransferConfig | None = None


def build_parser() -> argparse.ArgumentParser:
    d = FrontendConfig("", "")
    p = argparse.ArgumentParser(prog="kvpool-frontend", description="kvpool's OpenAI-compatible API server (a client of the scheduler).")
    g = p.add_argument_group("kvpool serve's settings (protocol/serve_flags/)")
    for row in rows_for(FRONTEND):
        add_flag(g, row)
    p.add_argument("--host", default=d.host, help="the API's address (default %(default)s)")
    p.add_argument("--port", type=int, default=d.port, help="the API's port (default %(default)s: the scheduler's HTTP port is 8000, the worker's 8001)")
    p.add_argument("--uds", default=None, help="listen on this Unix domain socket instead of --host and --port (default: none)")
    p.add_argument("--listen-fd", type=int, default=None, metavar="FD",
                   help="serve on this inherited listening socket, bound to --host/--port (kvpool serve's; default: bind)")
    p.add_argument("--scheduler", default=d.scheduler, help="the scheduler's client port (default %(default)s)")
    p.add_argument("--scheduler-http", default=d.scheduler_http, help="the scheduler's /health and /metrics (default %(default)s)")
    p.add_argument("--max-request-body-bytes", type=int, default=d.max_request_body_bytes, help="larger request bodies get 413 (default %(default)s)")
    p.add_argument("--connect-timeout", dest="connect_timeout_s", type=float, default=d.connect_timeout_s,
                   help="give up reaching the scheduler after this long, in s (default %(default)s)")
    p.add_argument("--scheduler-restart-timeout", dest="scheduler_restart_timeout_s", type=float, default=d.scheduler_restart_timeout_s,
                   metavar="SECONDS", help="when the scheduler's connection drops, requests wait this long for it to come back "
                                           "and then resume there; 0 fails them at once (default %(default)s)")
    p.add_argument("--curve-client-key", metavar="FILE", help="this client's secret certificate, NAME.key_secret (default: none, no CURVE)")
    p.add_argument("--curve-server-key", metavar="FILE", help="the scheduler's public certificate, NAME.key (default: none, no CURVE)")
    add_operator_args(p, d)
    add_serving_args(p)
    add_admission_args(p)
    return p


def add_operator_args(p: argparse.ArgumentParser, d: FrontendConfig) -> None:
    """vLLM's API-server flags, as ``vllm serve`` spells and parses them (lists as JSON,
    booleans with their --no- form)."""
    flag = argparse.BooleanOptionalAction
    p.add_argument("--api-key", nargs="+", default=None, help="keys of which /v1/* requires one as `Authorization: Bearer KEY` (default: VLLM_API_KEY, else none)")
    p.add_argument("--allowed-origins", type=json.loads, default=list(d.allowed_origins), help="CORS origins, a JSON list (default %(default)s: none)")
    p.add_argument("--allowed-methods", type=json.loads, default=list(d.allowed_methods), help="CORS methods, a JSON list (default %(default)s)")
    p.add_argument("--allowed-headers", type=json.loads, default=list(d.allowed_headers), help="CORS headers, a JSON list (default %(default)s)")
    p.add_argument("--allow-credentials", action=flag, default=d.allow_credentials, help="CORS credentials (default %(default)s)")
    p.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this key (default: none)")
    p.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate chain (default: none, plain HTTP)")
    p.add_argument("--ssl-ca-certs", default=None, help="CA certificates to verify clients with (default: none)")
    p.add_argument("--ssl-cert-reqs", type=int, default=d.ssl_cert_reqs, help="client certificates: 0 none, 1 optional, 2 required, as ssl.CERT_* (default %(default)s)")
    p.add_argument("--enable-ssl-refresh", action=flag, default=False, help="reload the key, certificate and CA files when they change (default %(default)s)")
    p.add_argument("--ssl-ciphers", default=None, help="OpenSSL cipher suites for TLS 1.2 and below, e.g. ECDHE-RSA-AES256-GCM-SHA384 (default: OpenSSL's)")
    p.add_argument("--enable-prompt-tokens-details", action=flag, default=False, help="usage gives prompt_tokens_details.cached_tokens (default %(default)s)")
    p.add_argument("--max-logprobs", type=int, default=d.max_logprobs, help="the most logprobs a request may ask for, at most 20 here (default %(default)s)")
    p.add_argument("--uvicorn-log-level", default=d.uvicorn_log_level, choices=list(_SERVER_LOG_LEVELS),
                   help="the HTTP server's own loggers and the access log (default %(default)s)")
    p.add_argument("--disable-uvicorn-access-log", action=flag, default=False, help="no line per request (default %(default)s)")
    p.add_argument("--disable-fastapi-docs", action=flag, default=False, help="no /openapi.json, /docs nor /redoc (default %(default)s)")
    p.add_argument("--root-path", default=None, help="a path prefix every route answers under as well, behind a proxy (default: none)")
    p.add_argument("--chat-template", default=None, help="a chat template file, or the template itself (default: the checkpoint's)")
    p.add_argument("--chat-template-content-format", default="auto", choices=["auto", "string", "openai"],
                   help="messages' content as a string or as OpenAI's parts; auto: what the template reads (default %(default)s)")
    p.add_argument("--response-role", default=d.response_role, help="the role of chat replies (default %(default)s)")
    p.add_argument("--enable-server-load-tracking", action=flag, default=False, help="/load counts the requests being served (default %(default)s: 0)")


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r} ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def add_serving_args(p: argparse.ArgumentParser) -> None:
    """vLLM's flags read by its serving classes and middleware, as ``vllm serve`` parses them."""
    flag = argparse.BooleanOptionalAction
    p.add_argument("--enable-request-id-headers", action=flag, default=False, help="X-Request-Id on every response (default %(default)s)")
    p.add_argument("--enable-force-include-usage", action=flag, default=False,
                   help="every stream gives usage, in each chunk and at its end, as stream_options.include_usage and continuous_usage_stats (default %(default)s)")
    p.add_argument("--override-generation-config", type=_json_object, default=None,
                   help='a JSON object of sampling defaults over --generation-config\'s, e.g. \'{"temperature": 0.5}\' (default: none)')
    p.add_argument("--default-chat-template-kwargs", type=_json_object, default=None,
                   help="a JSON object of chat template variables; a request's chat_template_kwargs win (default: none)")
    p.add_argument("--trust-request-chat-template", action=flag, default=False,
                   help="a request's chat_template (or chat_template_kwargs.chat_template) is rendered; else refused (default %(default)s)")
    p.add_argument("--disable-access-log-for-endpoints", default=None, help='paths the access log leaves out, comma-separated: "/health,/metrics" (default: none)')
    p.add_argument("--enable-log-outputs", action=flag, default=False, help="with --enable-log-requests, log each chat output (default %(default)s)")
    p.add_argument("--enable-log-deltas", action=flag, default=True, help="with --enable-log-outputs, log each streamed delta too (default %(default)s)")
    p.add_argument("--max-log-len", type=int, default=None, help="logged output text cut to this many characters (default: whole)")
    p.add_argument("--enable-tokenizer-info-endpoint", action=flag, default=False, help="serve GET /tokenizer_info (default %(default)s)")
    p.add_argument("--log-error-stack", action=flag, default=None, help="an error response logs its stack (default: VLLM_SERVER_DEV_MODE)")
    p.add_argument("--sse-keep-alive-interval", type=int, default=0,
                   help='a stream silent this many seconds gets a ": keep-alive" comment (default %(default)s: never)')
    p.add_argument("--enable-auto-tool-choice", action=flag, default=False,
                   help="tool_choice auto (and required, named) parsed from the model's text with --tool-call-parser (default %(default)s)")
    p.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="the model's tool-call format (default: none)")
    p.add_argument("--tool-strict-level", default="auto", choices=["auto", "function", "parameter"],
                   help="constrain every call's envelope (function), its arguments too (parameter), or as the request asks (default %(default)s)")
    p.add_argument("--exclude-tools-when-tool-choice-none", action=flag, default=False,
                   help="tool_choice none: the chat template is not shown the tools (default %(default)s)")


# --uvicorn-log-level's names, as logging levels (uvicorn's "trace" is 5).
_SERVER_LOG_LEVELS = {"critical": 50, "error": 40, "warning": 30, "info": 20, "debug": 10, "trace": 5}


def server_log_level(name: str) -> int:
    return _SERVER_LOG_LEVELS[name]


def config_from_args(argv: list[str] | None = None) -> FrontendConfig:
    p = build_parser()
    a = p.parse_args(argv)
    _settle_table_values(p, a)
    if not 0 <= a.port <= 65535:
        p.error(f"--port must be a port number, got {a.port}")
    if a.max_model_len < 2:
        p.error(f"--max-model-len must be at least 2, got {a.max_model_len}")
    if not 0 <= a.scheduler_restart_timeout_s < float("inf"):
        p.error(f"--scheduler-restart-timeout must be a number of seconds >= 0, got {a.scheduler_restart_timeout_s}")
    if (a.curve_client_key is None) != (a.curve_server_key is None):
        p.error("--curve-client-key and --curve-server-key go together")
    raw = os.environ.get("VLLM_MAX_N_SEQUENCES", str(DEFAULT_MAX_N_SEQUENCES))
    if not raw.strip().isdigit() or int(raw) < 1:
        p.error(f"VLLM_MAX_N_SEQUENCES must be a positive integer, got {raw!r}")
    a.max_n_sequences = int(raw)
    a.enforce_strict_tool_calling = os.environ.get("VLLM_ENFORCE_STRICT_TOOL_CALLING", "True").lower() in ("true", "1")
    _operator_env(p, a)
    _check_operator_args(p, a)
    check_admission_args(p, a)
    for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
        setattr(a, name, tuple(getattr(a, name)))
    return FrontendConfig(**vars(a))


def _settle_table_values(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """The settings table's values: --model required, one model name (default: --model)."""
    for row in rows_for(FRONTEND):
        if (line := unaccepted(row, getattr(a, row.dest))) is not None:
            p.error(line)
    if a.model is None:
        p.error("the following arguments are required: --model")
    a.served_model_name = one_name(a.served_model_name) or a.model
    a.max_model_len = FrontendConfig("", "").max_model_len if a.max_model_len is None else a.max_model_len


def _env_flag(p: argparse.ArgumentParser, name: str) -> bool:
    """An int-valued switch as vLLM reads VLLM_SERVER_DEV_MODE (``bool(int(...))``)."""
    raw = os.environ.get(name, "0").strip()
    try:
        return bool(int(raw))
    except ValueError:
        p.error(f"{name} must be an integer (0 or 1), got {raw!r}")


def _operator_env(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    # NOTE: as vLLM: --api-key wins over VLLM_API_KEY; empty keys are no keys.
    a.api_key = tuple(k for k in (a.api_key or [os.environ.get("VLLM_API_KEY")]) if k)
    a.dev_mode = a.dev_mode or _env_flag(p, "VLLM_SERVER_DEV_MODE")
    lora = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower()
    a.allow_runtime_lora_updating = lora in ("1", "true")
    if a.log_error_stack is None:  # NOTE: vLLM's default is VLLM_SERVER_DEV_MODE, not --dev-mode
        a.log_error_stack = _env_flag(p, "VLLM_SERVER_DEV_MODE")


def _check_operator_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
        value = getattr(a, name)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            p.error(f"--{name.replace('_', '-')} must be a JSON list of strings, got {value!r}")
    if a.ssl_keyfile and not a.ssl_certfile:
        p.error("--ssl-keyfile needs --ssl-certfile (the certificate the key belongs to)")
    if a.ssl_cert_reqs not in (ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED):
        p.error(f"--ssl-cert-reqs must be 0 (CERT_NONE), 1 (CERT_OPTIONAL) or 2 (CERT_REQUIRED), got {a.ssl_cert_reqs}")
    # NOTE: the scheduler bounds every request's logprobs at MAX_LOGPROBS (its worker
    # computes no more); vLLM's -1 (the whole vocabulary) is not served either.
    if not 0 <= a.max_logprobs <= MAX_LOGPROBS:
        p.error(f"--max-logprobs must be in [0, {MAX_LOGPROBS}] (kvpool's scheduler returns at most {MAX_LOGPROBS}), got {a.max_logprobs}")
    if a.chat_template is not None and (problem := chat_template_problem(a.chat_template)) is not None:
        p.error(problem)
    if a.enable_log_outputs and not a.enable_log_requests:
        p.error("--enable-log-outputs requires --enable-log-requests")
    if a.enable_auto_tool_choice and not a.tool_call_parser:
        p.error("--enable-auto-tool-choice requires --tool-call-parser")
    if a.sse_keep_alive_interval < 0:
        p.error("--sse-keep-alive-interval must be a non-negative integer (0 disables keep-alive comments)")
    a.uds = a.uds or None  # NOTE: as vLLM's `if args.uds`: an empty path is none
    if a.kv_transfer_config is not None:
        try:
            a.kv_transfer_config = parse_kv_transfer_config(a.kv_transfer_config)
        except ValueError as e:
            p.error(str(e))
    if a.root_path is not None:
        a.root_path = a.root_path.rstrip("/") or None
        if a.root_path is not None and not a.root_path.startswith("/"):
            p.error(f"--root-path must start with '/', got {a.root_path!r}")
