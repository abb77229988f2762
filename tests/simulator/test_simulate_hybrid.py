"""The simulator with hybrid KV-cache groups (simulator/layer_windows.py): the flags
give the server's groups; with a pool large enough to evict nothing the hits are the
one-group engine's but for the sliding groups' sparse retention (vLLM serve's
default: only the tails at replay boundaries and shared-prefix junctions); at equal
bytes the hybrid pool runs more requests at once than --disable-hybrid-kv-cache-manager;
and what the server refuses with hybrid groups is refused by flag."""

from __future__ import annotations

import argparse
import json

import pytest

from loadgen.datasets import shared_prefix_requests
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
            ["--layer-windows", "8,0", "--policy", "tail"],
            "hybrid KV-cache groups run with",
        ),
        (
            ["--layer-windows", "8,0", "--kv-offloading-blocks", "10"],
            "hybrid KV-cache groups run with",
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
