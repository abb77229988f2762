"""The load generator's command line: defaults in --help, and bad combinations refused
before anything runs (exit status 2, the flag named)."""

from __future__ import annotations

import argparse
import math

import pytest

from loadgen.config import build_parser, describe_workload, make_output_folders, parse_config


def _options() -> list[argparse.Action]:
    return [a for a in build_parser()._actions if a.option_strings and a.dest != "help"]


@pytest.mark.parametrize("action", _options(), ids=lambda a: a.option_strings[0])
def test_every_flag_has_help_that_names_its_default(action):
    assert action.help and "default" in action.help, action.option_strings[0]


def test_help_shows_the_default_values(capsys):
    with pytest.raises(SystemExit):
        parse_config(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    for words in ("(default tcp://127.0.0.1:5555)", "for kvpool, the scheduler's HTTP port 8000 on --scheduler's host)", "(default 256)",
                  "(default shared-prefix, or mooncake when --trace is given)", "(default inf)", "Exit status:"):
        assert words in out, words


def _refused(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as e:
        parse_config(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_a_trace_means_mooncake_and_refuses_another_dataset(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    assert parse_config(["--trace", str(trace)]).dataset == "mooncake"
    assert parse_config([]).dataset == "shared-prefix"
    err = _refused(capsys, ["--trace", str(trace), "--dataset", "shared-prefix"])
    assert "--trace" in err and "--dataset mooncake" in err and "shared-prefix" in err


@pytest.mark.parametrize("argv,words", [
    (["--num-requests", "0"], "--num-requests must be >= 1"),
    (["--max-input-len", "0"], "--max-input-len must be >= 1"),
    (["--dataset", "mooncake"], "--trace FILE"),
])
def test_bad_values_are_named(capsys, argv, words):
    assert words in _refused(capsys, argv)


def test_an_output_that_cannot_be_written_is_refused_before_the_run(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    err = _refused(capsys, ["--result-json", str(blocker / "sub" / "r.json")])
    assert "--result-json" in err and "is not a folder" in err
    assert "is a folder" in _refused(capsys, ["--plot", str(tmp_path)])
    assert not (blocker.parent / "sub").exists()  # nothing made


def test_missing_output_folders_are_made(tmp_path):
    cfg = parse_config(["--result-json", str(tmp_path / "out" / "r.json"), "--plot", str(tmp_path / "p" / "q" / "x.png")])
    assert not (tmp_path / "out").exists()
    make_output_folders(cfg)
    assert (tmp_path / "out").is_dir() and (tmp_path / "p" / "q").is_dir()


def test_the_workload_line_says_what_was_sent(tmp_path):
    cfg = parse_config(["--num-requests", "10", "--request-rate", "4", "--max-concurrency", "2"])
    assert describe_workload(cfg, 10) == (
        "shared-prefix: 10 requests (8 prefixes x 256 tokens + 64-token suffixes, 32 out), 4 req/s, concurrency 2, "
        "via http://127.0.0.1:8000/v1/completions"
    )
    cfg = parse_config(["--trace", str(tmp_path / "conv.jsonl"), "--max-input-len", "1024"])
    assert describe_workload(cfg, 3) == ("mooncake: 3 requests (conv.jsonl, time scale 1, prompts cut to 1024), at the trace's times, "
                                         "via http://127.0.0.1:8000/v1/completions")
    cfg = parse_config(["--scheduler", "tcp://127.0.0.1:7", "--num-requests", "1"])
    assert cfg.backend == "kvpool" and describe_workload(cfg, 1).endswith(", via kvpool client port tcp://127.0.0.1:7")
    cfg = parse_config(["--backend", "openai-chat"])
    assert cfg.endpoint == "/v1/chat/completions" and cfg.base_url == "http://127.0.0.1:8000"
    assert math.isinf(parse_config([]).request_rate)


def test_the_metrics_url_follows_the_server_unless_given():
    # An OpenAI server exports /metrics on its own port; the scheduler on its HTTP port.
    assert parse_config(["--base-url", "http://127.0.0.1:9500"]).metrics_url == "http://127.0.0.1:9500/metrics"
    assert parse_config(["--backend", "openai-chat", "--base-url", "http://h:9500/"]).metrics_url == "http://h:9500/metrics"
    assert parse_config(["--scheduler", "tcp://10.1.2.3:6000"]).metrics_url == "http://10.1.2.3:8000/metrics"
    assert parse_config(["--scheduler", "tcp://[::1]:6000"]).metrics_url == "http://[::1]:8000/metrics"
    assert parse_config([]).metrics_url == "http://127.0.0.1:8000/metrics"
    assert parse_config(["--base-url", "http://127.0.0.1:9500", "--metrics-url", "http://m:1/metrics"]).metrics_url == "http://m:1/metrics"
    assert parse_config(["--base-url", "http://127.0.0.1:9500", "--metrics-url", ""]).metrics_url is None


def test_the_default_scheduler_http_port_is_the_schedulers_own():
    # loadgen may not import the scheduler: its copy of the default must stay equal.
    from loadgen.config import SCHEDULER_HTTP_PORT
    from scheduler.engine.config import SchedulerConfig

    assert SCHEDULER_HTTP_PORT == SchedulerConfig().http_port
