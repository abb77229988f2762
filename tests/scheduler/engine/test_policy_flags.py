"""The scheduler process's scheduling-policy flags (scheduler/engine/args.py), under
vLLM 0.32's names and with its checks: bad values exit 2 naming the flag, nothing
started. vLLM 0.32 has no --max-num-partial-prefills / --max-long-partial-prefills
(``vllm serve`` answers "unrecognized arguments", status 2): neither has kvpool."""

from __future__ import annotations

import pytest

from scheduler.engine.args import config_from_args


def refused(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        config_from_args(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_defaults_are_vllms():
    c = config_from_args([])
    assert (c.scheduling_policy, c.long_prefill_token_threshold, c.long_prefill_token_threshold_adaptive) == ("fcfs", 0, False)
    assert c.enable_chunked_prefill is True and c.max_num_batched_tokens == 2048


def test_the_flags_reach_the_config():
    c = config_from_args(["--scheduling-policy", "priority", "--long-prefill-token-threshold", "512",
                          "--long-prefill-token-threshold-adaptive", "--no-async-scheduling"])
    assert (c.scheduling_policy, c.long_prefill_token_threshold, c.long_prefill_token_threshold_adaptive) == ("priority", 512, True)
    assert not hasattr(c, "async_scheduling")


def test_without_chunked_prefill_the_default_budget_rises_to_max_model_len():
    # vLLM: max(max_model_len, its default) when --max-num-batched-tokens is not given.
    assert config_from_args(["--no-enable-chunked-prefill"]).max_num_batched_tokens == 4096
    assert config_from_args(["--no-enable-chunked-prefill", "--max-model-len", "1024"]).max_num_batched_tokens == 2048
    c = config_from_args(["--no-enable-chunked-prefill", "--max-num-batched-tokens", "8192"])
    assert (c.enable_chunked_prefill, c.max_num_batched_tokens) == (False, 8192)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--no-enable-chunked-prefill", "--max-num-batched-tokens", "2048"],
         "--max-num-batched-tokens (2048) is smaller than --max-model-len (4096) with --no-enable-chunked-prefill"),
        (["--long-prefill-token-threshold", "5000"], "--long-prefill-token-threshold (5000) cannot be greater than the --max-model-len (4096)"),
        (["--long-prefill-token-threshold", "-1"], "--long-prefill-token-threshold must be >= 0"),
        (["--scheduling-policy", "lifo"], "argument --scheduling-policy: invalid choice: 'lifo'"),
        (["--async-scheduling"], "--async-scheduling: kvpool's scheduler does not support async scheduling yet"),
        (["--max-num-partial-prefills", "2"], "unrecognized arguments: --max-num-partial-prefills 2"),
        (["--max-long-partial-prefills", "1"], "unrecognized arguments: --max-long-partial-prefills 1"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(argv, message, capsys):
    assert message in refused(argv, capsys)
