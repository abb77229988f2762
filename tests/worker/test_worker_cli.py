"""``python -m worker``'s command line: help for every flag, clear errors for bad values."""

from __future__ import annotations

import argparse

import pytest

from worker.__main__ import config_from_args
from worker.args import build_parser


def _options() -> list[argparse.Action]:
    return [a for a in build_parser()._actions if a.option_strings and a.dest != "help"]


@pytest.mark.parametrize("action", _options(), ids=lambda a: a.option_strings[0])
def test_every_flag_has_help_that_names_its_default(action):
    assert action.help, f"{action.option_strings[0]} has no help"
    assert "default" in action.help, f"{action.option_strings[0]}: its help does not give the default"


def test_help_shows_the_default_values(capsys):
    with pytest.raises(SystemExit):
        config_from_args(["--help"])
    out = capsys.readouterr().out
    for words in ("(default tcp://127.0.0.1:5556)", "(default 16)", "(default 10.0)", "(default INFO)", "(default: off)"):
        assert words in " ".join(out.split()), words


@pytest.mark.parametrize("value", ["-4MiB", "-1.5G", "-.5G"])
@pytest.mark.parametrize("joined", [False, True])
def test_a_negative_kv_cache_memory_is_named_as_such(capsys, value, joined):
    argv = [f"--kv-cache-memory={value}"] if joined else ["--kv-cache-memory", value]
    with pytest.raises(SystemExit) as e:
        config_from_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--kv-cache-memory" in err and "cannot be negative" in err and "expected one argument" not in err


@pytest.mark.parametrize("endpoint", ["nonsense", "tcp://", "http://127.0.0.1:5556"])
def test_a_scheduler_that_is_not_an_endpoint_is_a_clear_error(capsys, endpoint):
    with pytest.raises(SystemExit) as e:
        config_from_args(["--scheduler", endpoint])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"--scheduler {endpoint!r} is not a ZeroMQ endpoint" in err and "tcp://127.0.0.1:5556" in err


def test_a_negative_number_for_another_flag_still_reaches_its_check(capsys):
    with pytest.raises(SystemExit):
        config_from_args(["--block-size", "-4"])
    assert "--block-size must be positive" in capsys.readouterr().err


def test_the_profiled_steps_shape_reaches_the_config(capsys):
    c = config_from_args(["--device", "cpu", "--max-num-batched-tokens", "4096", "--max-num-seqs", "32"])
    assert (c.max_num_batched_tokens, c.max_num_seqs) == (4096, 32)
    with pytest.raises(SystemExit):
        config_from_args(["--device", "cpu", "--max-num-seqs", "0"])
    assert "--max-num-seqs must be positive, got 0" in capsys.readouterr().err
