"""The simulator takes the server's --kv-eviction-policy (simulator/cli.py,
engine.py): fast-forwarding still changes nothing under every policy, a run per
policy lands in the table, and the what-if free policies are refused beside a
policy that orders the queue itself."""

from __future__ import annotations

import dataclasses

import pytest

from scheduler.core.retention.eviction_policies import KV_EVICTION_POLICIES
from simulator.cli import main, parse_args
from simulator.config import SimConfig
from simulator.replay import simulate
from tests.simulator.test_simulate_policy import _equivalence_case, workload


@pytest.mark.parametrize("policy", KV_EVICTION_POLICIES)
def test_fast_forward_changes_nothing_under_each_eviction_policy(policy):
    n = 80
    w = workload(n, 70, [i * 0.013 for i in range(n)], levels=3)
    cfg = SimConfig(90, 4, max_num_seqs=6, max_num_batched_tokens=128, eviction_policy=policy)
    _equivalence_case(w, cfg)
    _equivalence_case(w, dataclasses.replace(cfg, scheduling_policy="priority"))


def test_policies_differ_where_reuse_does():
    # 4 shared prefixes of 10 blocks, little room: which cached blocks survive decides hits.
    w = workload(120, 8, [i * 0.01 for i in range(120)])
    results = {p: simulate(w, SimConfig(40, 4, max_num_seqs=2, max_num_batched_tokens=128, eviction_policy=p)) for p in KV_EVICTION_POLICIES}
    assert all(r.num_finished == 120 for r in results.values())
    assert len({r.prefix_cache_hits for r in results.values()}) > 1
    assert all(r.eviction_policy == p for p, r in results.items())


def test_cli_runs_each_policy_and_refuses_tail_with_another_policy(capsys):
    assert main(["--dataset", "shared-prefix", "--num-requests", "20", "--num-blocks", "60", "--kv-eviction-policy", "lru,s3fifo"]) == 0
    table = capsys.readouterr().out
    assert "s3fifo" in table and " lru " in table
    with pytest.raises(SystemExit):
        parse_args(["--num-blocks", "60", "--policy", "tail", "--kv-eviction-policy", "arc"])
    assert "--policy tail/forward" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--num-blocks", "60", "--kv-eviction-policy", "mru"])
    assert "unknown eviction policy 'mru'" in capsys.readouterr().err


def test_a_pinned_system_prompt_hits_in_full_through_a_flood_and_unpinned_it_does_not():
    from loadgen.datasets import SampleRequest
    from simulator.workload import SampleWorkload

    system = list(range(10, 42))  # 8 blocks of 4
    prompts = []
    for i in range(10):
        prompts.append(system + [100 + i] * 4)
        prompts += [[200 + 40 * i + j] * 40 for j in range(2)]  # 2 unique prompts of 10 blocks between
    w = SampleWorkload([SampleRequest(p, 2) for p in prompts], [0.1 * i for i in range(len(prompts))], 600)
    cfg = SimConfig(21, 4, max_num_seqs=1, max_num_batched_tokens=128)
    pinned = simulate(w, dataclasses.replace(cfg, pin_prefix_tokens=len(system)))
    unpinned = simulate(w, cfg)
    # Unique prompts never hit: every hit is the system prompt's. Pinned: all 32 tokens
    # of each of its 10 requests (the first included: pinned before the replay).
    assert pinned.num_pinned_blocks == 8 and pinned.prefix_cache_hits == 10 * 32
    assert unpinned.num_pinned_blocks == 0 and unpinned.prefix_cache_hits < 10 * 32
