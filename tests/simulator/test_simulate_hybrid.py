"""The simulator with hybrid KV-cache groups (simulator/layer_windows.py): the flags
give the server's groups; with a pool large enough to evict nothing the hits are the
one-group engine's but for the sliding groups' sparse retention (vLLM serve's
default: only the tails at replay boundaries and shared-prefix junctions); at equal
bytes the hybrid pool runs more requests at once than --disable-hybrid-kv-cache-manager;
and what the simulator does not model with hybrid groups (P/D, kv_aware) is refused by flag
(the tiers and replicas: tests/simulator/test_hybrid_tiers_sim.py)."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from loadgen.datasets import SampleRequest, shared_prefix_requests
from simulator.cli import main, parse_args
from simulator.config import SimConfig
from simulator.layer_windows import parse_layer_windows
from simulator.replay import simulate
from simulator.workload import SampleWorkload

BS = 16


def workload(n: int = 24) -> SampleWorkload:
    samples = shared_prefix_requests(n, 3, 256, 48, 40, 512, 0)
    return SampleWorkload(samples, [0.0] * n, 512)


def test_layer_windows_parse_as_patterns():
    assert parse_layer_windows("512x5,0") == [512] * 5 + [0]
    assert parse_layer_windows("0, 8 ,8x2") == [0, 8, 8, 8]
    for bad in ("x5", "8x0", "-1", "8y2"):
        with pytest.raises(argparse.ArgumentTypeError, match="--layer-windows"):
            parse_layer_windows(bad)


def test_flags_give_the_servers_groups():
    base = ["--dataset", "shared-prefix", "--num-blocks", "100"]
    a = parse_args([*base, "--layer-windows", "512x5,0", "--num-layers", "26"])
    assert a.group_windows == (512,) * 6 + (0,)  # Gemma 3 1B: 7 groups (protocol.kv_cache_spec)
    b = parse_args(
        [*base, "--sliding-window", "512", "--sliding-window-pattern", "6", "--num-layers", "26"]
    )
    assert b.group_windows == a.group_windows
    assert parse_args(
        [*base, "--layer-windows", "512x5,0", "--disable-hybrid-kv-cache-manager"]
    ).group_windows == (0,)
    assert parse_args(base).group_windows == () and parse_args(base).groups is None


def test_a_checkpoints_config_gives_its_groups(tmp_path):
    # Gemma 3's config.json as transformers writes it: layer_types name each layer.
    cfg = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "num_hidden_layers": 6,
           "sliding_window": 128, "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    base = ["--dataset", "shared-prefix", "--num-blocks", "100", "--model-config"]
    assert parse_args([*base, str(tmp_path)]).group_windows == (128,) * 5 + (0,)
    assert parse_args([*base, str(tmp_path / "config.json")]).groups == parse_args(
        ["--dataset", "shared-prefix", "--num-blocks", "100", "--layer-windows", "128x5,0"]
    ).groups


@pytest.mark.parametrize(
    "flags,message",
    [
        (
            ["--layer-windows", "8,0", "--replicas", "2", "--router", "kv_aware"],
            "hybrid KV-cache groups run without --router kv_aware: its index holds a block hash per replica",
        ),
        (
            ["--layer-windows", "8,0,16", "--disable-hybrid-kv-cache-manager"],
            "at most one sliding window size",
        ),
        (["--sliding-window", "8"], "go together"),
        (["--num-layers", "4"], "need --layer-windows"),
        (["--model-config", "/nonexistent/kvpool"], "--model-config /nonexistent/kvpool: "),
        (["--model-config", "/tmp", "--layer-windows", "8,0"], "not with --layer-windows"),
    ],
)
def test_what_hybrid_groups_do_not_support_is_refused_by_flag(flags, message, capsys):
    with pytest.raises(SystemExit):
        main(["--dataset", "shared-prefix", "--num-blocks", "100", *flags])
    assert message in capsys.readouterr().err


def test_with_nothing_evicted_the_hits_are_the_one_group_engines_but_the_junctions():
    one = simulate(workload(), SimConfig(num_blocks=4000, block_size=BS, max_num_seqs=4))
    hybrid = simulate(
        workload(), SimConfig(num_blocks=4000, block_size=BS, max_num_seqs=4, group_windows=(64, 0))
    )
    assert one.num_evictions == hybrid.num_evictions == 0
    assert one.prefix_cache_queries == hybrid.prefix_cache_queries == 24 * 304
    # 3 prefixes of 256 tokens, 8 requests each (304-token prompts). One group: every
    # request but a prefix's first hits the 256. Hybrid (window 64: a sliding hit needs
    # the 4 blocks ending at it): a prefix's first request caches its sliding tail at
    # its own prompt's end (303), past the prefix, so the second misses; its lookup
    # (full attention hit 256 tokens) sets its junction there, its tail at 256 is
    # cached, and every later request hits the 256 tokens.
    assert (one.prefix_cache_hits, hybrid.prefix_cache_hits) == (21 * 256, 18 * 256)


def test_at_equal_bytes_hybrid_groups_hold_more_requests():
    # Six layers, five of window 64: a block spans one layer's KV instead of six, so the
    # same bytes are six times the blocks.
    full = simulate(workload(), SimConfig(num_blocks=120, block_size=BS, max_num_seqs=24))
    hybrid = simulate(
        workload(),
        SimConfig(num_blocks=720, block_size=BS, max_num_seqs=24, group_windows=(64,) * 5 + (0,)),
    )
    assert hybrid.num_preemptions < full.num_preemptions
    # NOTE: not a shorter queueing delay here: the hybrid run computes 768 more prompt
    # tokens (three junction misses, the test above), outweighing its fewer preemptions.
    assert (full.prefix_cache_hits, hybrid.prefix_cache_hits) == (21 * 256, 18 * 256)
    assert hybrid.num_rejected == full.num_rejected == 0


def test_a_pinned_system_prompt_hits_in_full_with_hybrid_groups():
    # Block size 4, window 8 (a sliding hit needs the 2 blocks ending at it): the pin holds
    # full attention's 8 blocks of the system prompt and the sliding group's 2 ending there.
    system = list(range(10, 42))
    prompts = []
    for i in range(10):
        prompts.append(system + [100 + i] * 4)
        prompts += [[200 + 40 * i + j] * 40 for j in range(2)]  # 2 unique prompts of 10 blocks between
    w = SampleWorkload([SampleRequest(p, 2) for p in prompts], [0.1 * i for i in range(len(prompts))], 600)
    cfg = SimConfig(41, 4, max_num_seqs=1, max_num_batched_tokens=128, group_windows=(8, 0))
    pinned = simulate(w, dataclasses.replace(cfg, pin_prefix_tokens=len(system)))
    unpinned = simulate(w, cfg)
    assert pinned.num_pinned_blocks == 8 + 2 and pinned.prefix_cache_hits == 10 * 32
    assert unpinned.num_pinned_blocks == 0 and unpinned.prefix_cache_hits < 10 * 32
