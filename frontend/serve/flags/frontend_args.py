"""``vllm serve``'s Frontend group: the OpenAI-compatible HTTP server's flags."""

from __future__ import annotations

from frontend.serve.flags import reasons as why
from frontend.serve.flags.rules import (
    BOOL,
    MANY,
    ONE,
    PASSED,
    Group,
    Rule,
    declared,
    handled,
    passed,
    refused,
)
from frontend.tools.parsers import TOOL_PARSERS
from protocol.serve_flags.engine import RETURN_TOKENS_AS_TOKEN_IDS

_TITLE = "Frontend"
_DESCRIPTION = "Arguments for the OpenAI-compatible frontend server."

FRONT = "frontend"
_RULES = [
    passed("--allow-credentials", BOOL, FRONT),
    passed("--allowed-headers", ONE, FRONT),
    passed("--allowed-methods", ONE, FRONT),
    passed("--allowed-origins", ONE, FRONT),
    refused("--anthropic-disabled-thinking-effort", ONE, "kvpool has no Anthropic /v1/messages endpoint"),
    passed("--api-key", MANY, FRONT),
    passed("--chat-template", ONE, FRONT),
    passed("--chat-template-content-format", ONE, FRONT),
    refused("--cohere-format", ONE, "Cohere-specific chat rendering is not supported", accepts=("cmd4",)),
    refused("--cohere-is-reasoning-model", BOOL, "Cohere-specific chat rendering is not supported", accepts=(True,)),
    refused("--data-parallel-supervisor-port", ONE, why.ONE_ENGINE),
    passed("--default-chat-template-kwargs", ONE, FRONT),
    passed("--disable-access-log-for-endpoints", ONE, FRONT),
    passed("--disable-fastapi-docs", BOOL, FRONT),
    passed("--disable-uvicorn-access-log", BOOL, FRONT),
    refused("--dp-supervisor-probe-failure-threshold", ONE, why.ONE_ENGINE),
    refused("--dp-supervisor-probe-interval-s", ONE, why.ONE_ENGINE),
    refused("--dp-supervisor-probe-timeout-s", ONE, why.ONE_ENGINE),
    passed("--enable-auto-tool-choice", BOOL, FRONT),
    refused("--enable-flash-late-interaction", BOOL, why.POOLING, accepts=(True,)),
    passed("--enable-force-include-usage", BOOL, FRONT),
    passed("--enable-log-deltas", BOOL, FRONT, default_on=True),
    passed("--enable-log-outputs", BOOL, FRONT),
    refused("--enable-offline-docs", BOOL, "kvpool's /docs loads Swagger UI from its CDN as vLLM's default does; it ships no local copy to serve offline", accepts=(False,)),
    refused("--enable-per-request-metrics", BOOL, why.NOT_YET, accepts=(False,)),
    passed("--enable-prompt-tokens-details", BOOL, FRONT),
    passed("--enable-request-id-headers", BOOL, FRONT),
    refused("--enable-scale-out", BOOL, why.ONE_ENGINE, accepts=(False,)),
    passed("--enable-server-load-tracking", BOOL, FRONT),
    passed("--enable-ssl-refresh", BOOL, FRONT),
    passed("--enable-tokenizer-info-endpoint", BOOL, FRONT),
    passed("--exclude-tools-when-tool-choice-none", BOOL, FRONT),
    refused("--fingerprint-mode", ONE, why.NOT_YET),
    refused("--fingerprint-value", ONE, why.NOT_YET),
    refused("--grpc-port", ONE, why.GRPC),
    refused("--h11-max-header-count", ONE, why.UVICORN),
    refused("--h11-max-incomplete-event-size", ONE, why.UVICORN),
    handled("--host", ONE, "frontend (default 127.0.0.1, where vLLM listens on every interface)", default="127.0.0.1",
            help="the API's address (default %(default)s: loopback, where vLLM listens on every interface)"),
    passed("--log-error-stack", BOOL, FRONT, default_on=True),
    refused("--lora-modules", MANY, why.LORA),
    passed("--max-log-len", ONE, FRONT),
    refused("--middleware", ONE, "kvpool's frontend is aiohttp: ASGI middleware cannot be loaded"),
    handled("--port", ONE, "frontend", type=int, default=8000, help="the API's port (default %(default)s)"),
    passed("--response-role", ONE, FRONT),
    declared(RETURN_TOKENS_AS_TOKEN_IDS, BOOL, "frontend"),
    passed("--root-path", ONE, FRONT),
    passed("--sse-keep-alive-interval", ONE, FRONT),
    passed("--ssl-ca-certs", ONE, FRONT),
    passed("--ssl-cert-reqs", ONE, FRONT),
    passed("--ssl-certfile", ONE, FRONT),
    passed("--ssl-ciphers", ONE, FRONT),
    passed("--ssl-keyfile", ONE, FRONT),
    refused("--tokens-only", BOOL, "kvpool has no Tokens In<>Out endpoints (vLLM's /inference/v1/generate) to serve alone", accepts=(False,)),
    Rule(("--tool-call-parser",), ONE, PASSED, f"passed to the frontend: {', '.join(TOOL_PARSERS)} (vLLM's other parsers refused)",
         accepts=tuple(TOOL_PARSERS), why_not=f"kvpool has only the {', '.join(TOOL_PARSERS)} tool-call parsers", to=(FRONT,)),
    refused("--tool-parser-plugin", ONE, "tool parser plugins (vLLM's Python ToolParser classes) cannot be loaded: "
            f"kvpool has the {', '.join(TOOL_PARSERS)} tool-call parsers"),
    refused("--tool-server", ONE, "kvpool has no Responses API (/v1/responses) whose built-in tools a tool server serves"),
    passed("--tool-strict-level", ONE, FRONT),
    passed("--trust-request-chat-template", BOOL, FRONT),
    refused("--trust-request-mm-kwargs", BOOL, why.MULTIMODAL, accepts=(False,)),
    passed("--uds", ONE, FRONT),
    passed("--uvicorn-log-level", ONE, FRONT),
]
GROUPS = [Group(_TITLE, _DESCRIPTION, _RULES)]
