"""The settings table's rows of vLLM's Frontend and ModelConfig groups that its serving
classes read in the API server: chat templates, logprobs, usage, tool calls, the
request log. ``kvpool serve`` passes each to the API server as given
(frontend/serve/flags/)."""

from __future__ import annotations

import argparse

from protocol.serve_flags.flag import FRONTEND, flag
from protocol.serve_flags.values import json_object

# NOTE: the API server's tool-call parsers (frontend/tools/parsers TOOL_PARSERS, checked equal
# by tests/frontend/test_config_rows.py); vLLM's others are refused by kvpool serve.
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "llama4_json")

ON_OFF = argparse.BooleanOptionalAction

CHAT_TEMPLATE = flag("--chat-template", FRONTEND, default=None, help="a chat template file, or the template itself (default: the checkpoint's)")
CHAT_TEMPLATE_CONTENT_FORMAT = flag("--chat-template-content-format", FRONTEND, default="auto", choices=("auto", "string", "openai"),
                                    help="messages' content as a string or as OpenAI's parts; auto: what the template reads "
                                         "(default %(default)s)")
DEFAULT_CHAT_TEMPLATE_KWARGS = flag("--default-chat-template-kwargs", FRONTEND, type=json_object, default=None,
                                    help="a JSON object of chat template variables; a request's chat_template_kwargs win (default: none)")
TRUST_REQUEST_CHAT_TEMPLATE = flag("--trust-request-chat-template", FRONTEND, action=ON_OFF, default=False,
                                   help="a request's chat_template (or chat_template_kwargs.chat_template) is rendered; else "
                                        "refused (default %(default)s)")
RESPONSE_ROLE = flag("--response-role", FRONTEND, default="assistant", help="the role of chat replies (default %(default)s)")
MAX_LOGPROBS = flag("--max-logprobs", FRONTEND, type=int, default=20,
                    help="the most logprobs a request may ask for, at most 20 here (default %(default)s)")
OVERRIDE_GENERATION_CONFIG = flag("--override-generation-config", FRONTEND, type=json_object, default=None,
                                  help='a JSON object of sampling defaults over --generation-config\'s, e.g. \'{"temperature": 0.5}\' '
                                       "(default: none)")
ENABLE_PROMPT_TOKENS_DETAILS = flag("--enable-prompt-tokens-details", FRONTEND, action=ON_OFF, default=False,
                                    help="usage gives prompt_tokens_details.cached_tokens (default %(default)s)")
ENABLE_FORCE_INCLUDE_USAGE = flag("--enable-force-include-usage", FRONTEND, action=ON_OFF, default=False,
                                  help="every stream gives usage, in each chunk and at its end, as stream_options.include_usage and "
                                       "continuous_usage_stats (default %(default)s)")
ENABLE_AUTO_TOOL_CHOICE = flag("--enable-auto-tool-choice", FRONTEND, action=ON_OFF, default=False,
                               help="tool_choice auto (and required, named) parsed from the model's text with --tool-call-parser "
                                    "(default %(default)s)")
TOOL_CALL_PARSER = flag("--tool-call-parser", FRONTEND, default=None, choices=TOOL_CALL_PARSERS, accepts=TOOL_CALL_PARSERS,
                        why_not=f"kvpool has only the {', '.join(TOOL_CALL_PARSERS)} tool-call parsers",
                        help="the model's tool-call format (default: none)")
TOOL_STRICT_LEVEL = flag("--tool-strict-level", FRONTEND, default="auto", choices=("auto", "function", "parameter"),
                         help="constrain every call's envelope (function), its arguments too (parameter), or as the request asks "
                              "(default %(default)s)")
EXCLUDE_TOOLS_WHEN_TOOL_CHOICE_NONE = flag("--exclude-tools-when-tool-choice-none", FRONTEND, action=ON_OFF, default=False,
                                           help="tool_choice none: the chat template is not shown the tools (default %(default)s)")
ENABLE_LOG_OUTPUTS = flag("--enable-log-outputs", FRONTEND, action=ON_OFF, default=False,
                          help="with --enable-log-requests, log each chat output (default %(default)s)")
ENABLE_LOG_DELTAS = flag("--enable-log-deltas", FRONTEND, action=ON_OFF, default=True,
                         help="with --enable-log-outputs, log each streamed delta too (default %(default)s)")
MAX_LOG_LEN = flag("--max-log-len", FRONTEND, type=int, default=None, help="logged output text cut to this many characters (default: whole)")
# NOTE: None: vLLM's default, VLLM_SERVER_DEV_MODE, read by the API server (so kvpool serve passes --no- too).
LOG_ERROR_STACK = flag("--log-error-stack", FRONTEND, action=ON_OFF, default=None,
                       help="an error response logs its stack (default: VLLM_SERVER_DEV_MODE)")
ROWS = (CHAT_TEMPLATE, CHAT_TEMPLATE_CONTENT_FORMAT, DEFAULT_CHAT_TEMPLATE_KWARGS, TRUST_REQUEST_CHAT_TEMPLATE, RESPONSE_ROLE,
        MAX_LOGPROBS, OVERRIDE_GENERATION_CONFIG, ENABLE_PROMPT_TOKENS_DETAILS, ENABLE_FORCE_INCLUDE_USAGE, ENABLE_AUTO_TOOL_CHOICE,
        TOOL_CALL_PARSER, TOOL_STRICT_LEVEL, EXCLUDE_TOOLS_WHEN_TOOL_CHOICE_NONE, ENABLE_LOG_OUTPUTS, ENABLE_LOG_DELTAS, MAX_LOG_LEN,
        LOG_ERROR_STACK)
