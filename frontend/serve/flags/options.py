"""``vllm serve``'s flags outside any config group (its ``options:`` in --help)."""

from __future__ import annotations

from frontend.serve.flags import reasons as why
from frontend.serve.flags.rules import BOOL, ONE, SWITCH, Group, declared, handled, refused, same
from protocol.serve_flags.engine import DISABLE_LOG_STATS, ENABLE_LOG_REQUESTS

_TITLE = "options"
_DESCRIPTION = ""

_RULES = [
    same("--aggregate-engine-logging", SWITCH, "a kvpool serve is one engine, so its stats line is already the aggregate"),
    refused("--api-server-count -asc", ONE, "kvpool serve runs one API server process", accepts=("1",)),
    handled("--config", ONE, "launcher: the YAML's flags are read before the command line's, which override them",
            default=None, metavar="FILE.yaml", help="read flags from a YAML file (vLLM's format); the command line overrides it"),
    declared(DISABLE_LOG_STATS, SWITCH, "scheduler"),
    declared(ENABLE_LOG_REQUESTS, BOOL, "frontend"),
    refused("--fail-on-environ-validation", BOOL,
            "kvpool always fails on a bad value of an environment variable it reads", accepts=(True,)),
    refused("--gdn-prefill-backend", ONE, why.KERNELS),
    refused("--grpc", SWITCH, why.GRPC),
    refused("--headless", SWITCH, why.ONE_ENGINE),
    refused("--kda-decode-backend", ONE, why.KERNELS),
    refused("--kda-prefill-backend", ONE, why.KERNELS),
    refused("--shutdown-timeout", ONE,
            "kvpool serve does not drain requests on SIGTERM: they end at once, as vLLM's --shutdown-timeout 0", accepts=("0",)),
]
GROUPS = [Group(_TITLE, _DESCRIPTION, _RULES)]
