"""--prefix-match-unit and --prefill-schedule-interval in the scheduler process, as vLLM
0.32 checks them with one KV cache group and one engine (scheduler/engine/one_group_flags.py):
the block size (16 unless --block-size) is the only unit allowed with prefix caching on,
any positive unit with it off; any interval >= 1; both change nothing downstream."""

from __future__ import annotations

import dataclasses

import pytest

from scheduler.engine.args import config_from_args


def refused(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        config_from_args(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "without"),
    [(["--prefix-match-unit", "16"], []), (["--block-size", "32", "--prefix-match-unit", "32"], ["--block-size", "32"]),
     (["--no-enable-prefix-caching", "--prefix-match-unit", "8"], ["--no-enable-prefix-caching"]),
     (["--prefill-schedule-interval", "4"], [])],
)
def test_accepted_values_change_nothing(argv, without):
    plain = dataclasses.asdict(config_from_args(without))
    assert dataclasses.asdict(config_from_args(argv)) == plain
    assert not {"prefix_match_unit", "prefill_schedule_interval"} & set(plain)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prefix-match-unit", "8"], "Invalid prefix_match_unit=8; with a single KV cache group, prefix-cache hits "
                                       "land on the block size (16). Unset it or set it to 16."),
        (["--block-size", "32", "--prefix-match-unit", "16"], "Invalid prefix_match_unit=16; with a single KV cache "
                                                              "group, prefix-cache hits land on the block size (32)."),
        (["--prefix-match-unit", "0"], "--prefix-match-unit must be > 0, got 0"),
        (["--no-enable-prefix-caching", "--prefix-match-unit", "-4"], "--prefix-match-unit must be > 0, got -4"),
        (["--prefill-schedule-interval", "0"], "--prefill-schedule-interval must be >= 1, got 0"),
    ],
)
def test_bad_values_exit_2_in_vllms_words(argv, message, capsys):
    assert message in refused(argv, capsys)
