"""The simulator with hybrid KV-cache groups and the tiers below the device: a revisit's
prefix comes back from the host tier, and from the external tier after a restart, in
every group (the full group's blocks before the hit's end, each sliding group's two
blocks ending there); each block moved is one group's, so it costs that group's share of
--kv-bytes-per-token; hit tokens are the hit's tokens, not its keys; --replicas runs.

The workload: block size 4, three layers, windows (8, 8, 0): protocol.kv_cache_spec
groups them one layer a group (two sliding groups of window 8, one full group), so a
block spans one layer's KV: 3000 bytes a token over the three layers -> 1000 a layer ->
a block of 4 tokens is 4000 bytes (one group: 3 layers, 12000). Requests, one at a time:
R0 the 16-token prompt P, R1 and R2 16 unique tokens each, R3 P and 4 more tokens.
"""

from __future__ import annotations

import dataclasses
import json

from loadgen.datasets import SampleRequest
from simulator.cli import main, parse_args
from simulator.config import SimConfig
from simulator.replay import simulate
from simulator.run_setup import sim_config
from simulator.workload import SampleWorkload

P = list(range(10, 26))
PROMPTS = [P, list(range(100, 116)), list(range(200, 216)), [*P, 300, 301, 302, 303]]
QUERIES = 16 * 3 + 20  # every prompt's tokens, looked up at its first admission

# 17 blocks (16 and the null one): a 16-token request holds 4 blocks in each of the 3
# groups while its prompt is computed, so R1 and R2 evict every block R0 cached.
HYBRID = SimConfig(17, 4, max_num_seqs=1, max_num_batched_tokens=64, group_windows=(8, 8, 0), num_layers=3,
                   num_block_layers=1, kv_bytes_per_token=3000)


def workload() -> SampleWorkload:
    return SampleWorkload([SampleRequest(p, 1) for p in PROMPTS], [1.0 * i for i in range(len(PROMPTS))], 600)


def test_a_block_moved_is_one_groups_share_of_the_bytes():
    assert HYBRID.block_bytes() == 3000 * 4 * 1 // 3 == 4000
    assert dataclasses.replace(HYBRID, num_layers=0, num_block_layers=0).block_bytes() == 12000
    # From the flags: 26 layers of Gemma 3's pattern make 7 groups of 4 layers (one block spans
    # 4 layers): 26000 bytes a token over 26 layers -> 1000 a layer -> 4 x 1000 x 16 a block.
    a = parse_args(["--dataset", "random", "--num-blocks", "100", "--layer-windows", "512x5,0", "--num-layers", "26",
                    "--kv-bytes-per-token", "26000"])
    assert sim_config(a, 100, 0, "vllm").block_bytes() == 4 * 1000 * 16
    one = parse_args(["--dataset", "random", "--num-blocks", "100", "--kv-bytes-per-token", "26000"])
    assert sim_config(one, 100, 0, "vllm").block_bytes() == 26000 * 16


def test_a_revisit_hits_in_the_host_tier_in_every_group():
    r = simulate(workload(), dataclasses.replace(HYBRID, num_host_blocks=64))
    assert r.num_finished == 4 and r.prefix_cache_hits == 0 and r.prefix_cache_queries == QUERIES
    # R0 cached the full group's blocks 0-3 and each sliding group's 1-2 (the two ending at its
    # replay boundary, token 15, floored to block 3): evicted, the 64 host slots keep them all.
    # R3 may hit 4 blocks (19 // 4); at 16 tokens the sliding groups need blocks 2-3 (3 is not
    # there), at 12 tokens blocks 1-2: a 12-token hit, 3 full blocks + 2 x 2 sliding = 7 loads.
    assert r.external_prefix_cache_hits == 12
    assert r.host_hit_rate == 12 / QUERIES and r.combined_hit_rate == 12 / QUERIES
    assert r.num_host_loads == 7 and r.bytes_loaded == 7 * 4000
    assert r.bytes_stored == r.num_host_stores * 4000
    assert r.load_time_s == 7 * 4000 / (HYBRID.offload_bandwidth_gbps * 1e9)


def test_one_group_counts_whole_model_blocks():
    # The same workload with one full-attention group of the three layers (6 blocks: R1 and
    # R2 evict R0's 4): R3 hits all 4 blocks of P, 16 tokens, 4 loads of 12000 bytes.
    one = dataclasses.replace(HYBRID, num_blocks=6, group_windows=(), num_layers=0, num_block_layers=0, num_host_blocks=64)
    r = simulate(workload(), one)
    assert r.external_prefix_cache_hits == 16 and r.num_host_loads == 4 and r.bytes_loaded == 4 * 12000


def test_the_external_tier_finds_the_first_runs_prefixes_after_a_restart():
    cold = simulate(workload(), dataclasses.replace(HYBRID, external_tier="disk"))
    # R3 finds what R0 saved, as in the host tier: 12 tokens, 7 blocks read.
    assert (cold.external_tier_hit_tokens, cold.external_tier_blocks_loaded) == (12, 7)
    assert cold.external_tier_bytes_read == 7 * 4000
    assert cold.external_tier_bytes_written == cold.external_tier_blocks_saved * 4000
    warm = simulate(workload(), dataclasses.replace(HYBRID, external_tier="disk", external_warm=True))
    assert warm.external_tier_warm_blocks == cold.external_tier_blocks_saved
    # R0, R1, R2 find their own first 3 blocks (the cap: 15 // 4): 12 tokens, 3 full blocks and
    # the sliding groups' 1-2; R3 4 blocks, 16 tokens (the first run's R3 saved the sliding 2-3
    # of P at its replay boundary), 4 full + 2 x 2 sliding. Tokens, not keys: 52, not 29 x 4.
    assert warm.external_tier_hit_tokens == 3 * 12 + 16 == 52
    assert warm.external_tier_blocks_loaded == 3 * 7 + 8
    assert warm.external_tier_bytes_read == 29 * 4000
    assert warm.external_tier_hit_rate == 52 / QUERIES and warm.num_finished == 4


def test_cli_runs_hybrid_groups_with_the_tiers_and_replicas(tmp_path, capsys):
    base = ["--dataset", "shared-prefix", "--num-requests", "12", "--num-prefixes", "2", "--prefix-len", "64",
            "--suffix-len", "16", "--output-len", "4", "--block-size", "4", "--layer-windows", "8,0"]
    out = tmp_path / "r.json"
    assert main([*base, "--num-blocks", "80", "--kv-offloading-blocks", "200", "--result-json", str(out)]) == 0
    assert "GB loaded" in capsys.readouterr().out
    assert json.loads(out.read_text())["results"][0]["num_finished"] == 12
    assert main([*base, "--num-blocks", "80", "--external-tier", "disk", "--external-tier-warm", "--result-json", str(out)]) == 0
    (r,) = json.loads(out.read_text())["results"]
    assert r["external_tier_hit_tokens"] > 0 and r["num_finished"] == 12
    assert main([*base, "--num-blocks", "80", "--policy", "tail,forward"]) == 0
    assert main([*base, "--num-blocks", "80", "--replicas", "2", "--router", "round_robin,cache_aware", "--jobs", "1",
                 "--kv-offloading-blocks", "100", "--result-json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [row["num_finished"] for row in rows] == [12, 12]
