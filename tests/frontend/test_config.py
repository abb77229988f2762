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
