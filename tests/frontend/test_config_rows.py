"""The settings table's rows whose choices are the API server's own implementations
(protocol/serve_flags/ may not import frontend/): the same names on both sides."""

from __future__ import annotations

from frontend.config import FrontendConfig, server_log_level
from frontend.tools.parsers import TOOL_PARSERS
from protocol.serve_flags import FRONTEND, rows_for
from protocol.serve_flags.http_server import UVICORN_LOG_LEVEL
from protocol.serve_flags.serving import TOOL_CALL_PARSER


def test_the_tool_call_parser_choices_are_the_api_servers_parsers():
    assert TOOL_CALL_PARSER.kwargs["choices"] == TOOL_CALL_PARSER.accepts == tuple(TOOL_PARSERS)


def test_every_uvicorn_log_level_is_a_logging_level():
    for name in UVICORN_LOG_LEVEL.kwargs["choices"]:
        assert server_log_level(name) > 0


def test_the_configs_defaults_are_the_rows():
    defaults = FrontendConfig("", "")
    resolved = {"api_key", "log_error_stack", "model", "served_model_name", "max_model_len", "kv_transfer_config"}
    for row in rows_for(FRONTEND):
        if row.dest not in resolved:
            value = getattr(defaults, row.dest)
            assert value == (tuple(row.default) if isinstance(row.default, list) else row.default), row.name
