"""`python -m frontend` on its own: its defaults meet the scheduler's and the worker's
defaults instead of colliding with them, and every flag's help gives its default."""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest

from frontend.config import build_parser, config_from_args
from scheduler.engine.config import SchedulerConfig
from worker.config import WorkerConfig


def _field_default(cls, name):
    return cls.__dataclass_fields__[name].default


def test_the_defaults_reach_the_default_scheduler_and_leave_its_ports_free():
    cfg = config_from_args(["--model", "m"])
    sched_http = _field_default(SchedulerConfig, "http_port")
    worker_http = _field_default(WorkerConfig, "http_port")
    assert cfg.port not in (sched_http, worker_http, _field_default(SchedulerConfig, "port"), _field_default(SchedulerConfig, "worker_port"))
    assert urlsplit(cfg.scheduler_http).port == sched_http
    assert urlsplit(cfg.scheduler.replace("tcp://", "http://")).port == _field_default(SchedulerConfig, "port")


@pytest.mark.parametrize("action", [a for a in build_parser()._actions if a.dest not in ("help", "model")], ids=lambda a: a.dest)
def test_every_flag_says_its_default(action):
    assert action.help and "default" in action.help, action.option_strings[0]


def test_help_shows_the_port_defaults(capsys):
    with pytest.raises(SystemExit):
        config_from_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default 8002:" in out and "(default http://127.0.0.1:8000)" in out and "(default tcp://127.0.0.1:5555)" in out


# --- vLLM's operator flags: parsed as `vllm serve` parses them ---------------------------


def test_operator_flags_parse_as_vllm_parses_them(monkeypatch):
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    d = config_from_args(["--model", "m"])
    assert (d.allowed_origins, d.allowed_methods, d.allowed_headers, d.allow_credentials) == ((), ("*",), ("*",), False)
    assert (d.ssl_cert_reqs, d.max_logprobs, d.uvicorn_log_level, d.response_role, d.root_path) == (0, 20, "info", "assistant", None)
    assert not (d.dev_mode or d.allow_runtime_lora_updating or d.enable_prompt_tokens_details or d.enable_server_load_tracking)
    c = config_from_args(["--model", "m", "--allowed-origins", '["http://a", "http://b"]', "--allowed-methods", '["GET"]',
                          "--allow-credentials", "--ssl-cert-reqs", "2", "--max-logprobs", "0", "--root-path", "/p/",
                          "--enable-prompt-tokens-details", "--no-enable-server-load-tracking", "--uvicorn-log-level", "trace"])
    assert (c.allowed_origins, c.allowed_methods, c.allow_credentials) == (("http://a", "http://b"), ("GET",), True)
    assert (c.ssl_cert_reqs, c.max_logprobs, c.root_path, c.uvicorn_log_level) == (2, 0, "/p", "trace")
    assert c.enable_prompt_tokens_details and not c.enable_server_load_tracking


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--allowed-origins", "http://a"], "--allowed-origins: invalid loads value"),
        (["--allowed-origins", '"http://a"'], "--allowed-origins must be a JSON list of strings"),
        (["--ssl-cert-reqs", "3"], "--ssl-cert-reqs must be 0 (CERT_NONE), 1 (CERT_OPTIONAL) or 2 (CERT_REQUIRED)"),
        (["--ssl-keyfile", "k.pem"], "--ssl-keyfile needs --ssl-certfile"),
        (["--max-logprobs", "21"], "--max-logprobs must be in [0, 20]"),
        (["--max-logprobs", "-1"], "--max-logprobs must be in [0, 20]"),
        (["--uvicorn-log-level", "DEBUG"], "invalid choice: 'DEBUG'"),
        (["--root-path", "pfx"], "--root-path must start with '/'"),
        (["--chat-template", "no-such-template.jinja"], "looks like a file path, but it is not a file"),
        (["--override-generation-config", "{temperature: 1}"], "--override-generation-config: must be a JSON object, got '{temperature: 1}'"),
        (["--default-chat-template-kwargs", "[1]"], "--default-chat-template-kwargs: must be a JSON object, got '[1]'"),
        (["--enable-log-outputs"], "--enable-log-outputs requires --enable-log-requests"),
        (["--sse-keep-alive-interval", "-1"], "--sse-keep-alive-interval must be a non-negative integer"),
    ],
)
def test_a_bad_operator_flag_is_refused_by_name(capsys, argv, words):
    with pytest.raises(SystemExit):
        config_from_args(["--model", "m", *argv])
    assert words in capsys.readouterr().err


def test_dev_mode_and_runtime_lora_come_from_vllms_variables(monkeypatch, capsys):
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", " TRUE ")
    c = config_from_args(["--model", "m"])
    assert c.dev_mode and c.allow_runtime_lora_updating
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "0")
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "yes")  # vLLM takes 1 or true only
    c = config_from_args(["--model", "m"])
    assert not c.dev_mode and not c.allow_runtime_lora_updating
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "yes")  # vLLM's int() refuses it too
    with pytest.raises(SystemExit):
        config_from_args(["--model", "m"])
    assert "VLLM_SERVER_DEV_MODE must be an integer" in capsys.readouterr().err


def test_log_error_stack_defaults_to_vllm_server_dev_mode_as_vllm(monkeypatch):
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    assert config_from_args(["--model", "m"]).log_error_stack
    assert not config_from_args(["--model", "m", "--no-log-error-stack"]).log_error_stack
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "0")
    assert not config_from_args(["--model", "m", "--dev-mode"]).log_error_stack  # kvpool's --dev-mode is not vLLM's variable
    assert config_from_args(["--model", "m", "--log-error-stack"]).log_error_stack
