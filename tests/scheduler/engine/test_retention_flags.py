"""--kv-eviction-policy and --max-pinned-fraction: on the scheduler (checked, exit 2
naming the flag), given to it by `kvpool serve` (only when not the default), and
the pool and manager the scheduler then builds."""

from __future__ import annotations

import pytest

from frontend.serve.cli import parse_serve
from frontend.serve.launcher import Launcher
from scheduler.core.block_pool import BlockPool
from scheduler.core.retention.eviction_policies import eviction_pool_factory, kv_cache_manager_class
from scheduler.core.retention.lfu_policy import LFUBlockPolicy
from scheduler.core.retention.priority_retention import PriorityBlockPolicy, PriorityKVCacheManager
from scheduler.engine.args import config_from_args


def scheduler_argv(*serve: str) -> list[str]:
    la = Launcher(parse_serve(["serve", "m", *serve]), log=lambda *a, **k: None)
    la.build()
    return la.children["scheduler"].argv[3:]


def test_defaults_and_values_reach_the_config():
    c = config_from_args([])
    assert (c.kv_eviction_policy, c.max_pinned_fraction) == ("lru", 0.5)
    c = config_from_args(["--kv-eviction-policy", "s3fifo", "--max-pinned-fraction", "0.25"])
    assert (c.kv_eviction_policy, c.max_pinned_fraction) == ("s3fifo", 0.25)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--kv-eviction-policy", "mru"], "argument --kv-eviction-policy: invalid choice: 'mru'"),
        (["--max-pinned-fraction", "1"], "--max-pinned-fraction must be in [0, 1), got 1.0"),
        (["--max-pinned-fraction", "-0.1"], "--max-pinned-fraction must be in [0, 1), got -0.1"),
    ],
)
def test_bad_values_exit_2_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        config_from_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_kvpool_serve_gives_the_scheduler_the_flags_it_was_given():
    argv = scheduler_argv()
    assert "--kv-eviction-policy" not in argv and "--max-pinned-fraction" not in argv
    c = config_from_args(scheduler_argv("--kv-eviction-policy", "arc", "--max-pinned-fraction", "0.2"))
    assert (c.kv_eviction_policy, c.max_pinned_fraction) == ("arc", 0.2)
    with pytest.raises(SystemExit):
        parse_serve(["serve", "m", "--max-pinned-fraction", "2"])


def test_the_pool_and_manager_built_for_each_choice():
    assert eviction_pool_factory("lru") is BlockPool and kv_cache_manager_class("fcfs").__name__ == "KVCacheManager"
    assert isinstance(eviction_pool_factory("lfu")(8).policy, LFUBlockPolicy)
    pool = eviction_pool_factory("lru", "priority")(8)
    assert isinstance(pool.policy, PriorityBlockPolicy) and kv_cache_manager_class("priority") is PriorityKVCacheManager
