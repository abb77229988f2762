"""The simulator with a host tier (the scheduler's own HostTier): hit rates by tier,
copies and bytes moved, and loads charged by bandwidth, against figures worked out
by hand; a tier raises the hit rate when the working set overflows the device."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from loadgen.datasets import SampleRequest, shared_prefix_requests
from simulator.cli import main
from simulator.config import SimConfig
from simulator.replay import simulate
from simulator.workload import SampleWorkload

BS = 4
PREFIX_A, PREFIX_B = list(range(10, 26)), list(range(40, 56))  # 16 tokens: 4 blocks each


def sequential(prompts: list[list[int]], output_len: int = 2) -> SampleWorkload:
    """One request every 100 virtual seconds: each is over before the next arrives."""
    return SampleWorkload([SampleRequest(p, output_len) for p in prompts], [100.0 * i for i in range(len(prompts))], 512)


def test_a_prefix_evicted_to_the_host_tier_is_loaded_back_as_worked_out_by_hand():
    # A, B, then A's prefix again with another suffix; 20-token prompts, 2 outputs: 6
    # blocks each (the 6th for the decode), and the device has 6, so B evicts all 5 of
    # A's hashed blocks (to the tier) and the third request evicts B's 5.
    workload = sequential([PREFIX_A + [1, 2, 3, 4], PREFIX_B + [5, 6, 7, 8], PREFIX_A + [9, 9, 9, 9]])
    # 1,000 KV bytes a token: 4,000 a block; 4 blocks at 0.002 GB/s load in 8 ms.
    base = dict(num_blocks=7, block_size=BS, max_num_seqs=1, step_overhead_ms=5.0, ms_per_token=1.0, kv_bytes_per_token=1000)
    with_tier = simulate(workload, SimConfig(**base, num_host_blocks=64, offload_bandwidth_gbps=0.002))
    without = simulate(workload, SimConfig(**base))
    assert (with_tier.prefix_cache_queries, with_tier.prefix_cache_hits) == (60, 0)
    # The third request: its 4 prefix blocks (16 tokens, under the 19 it may hit) are in the tier.
    assert (with_tier.external_prefix_cache_queries, with_tier.external_prefix_cache_hits) == (60, 16)
    assert with_tier.host_hit_rate == with_tier.combined_hit_rate == pytest.approx(16 / 60)
    assert with_tier.external_prefix_cache_hit_rate == pytest.approx(16 / 60)
    assert (with_tier.num_host_stores, with_tier.num_host_loads, with_tier.num_host_evictions) == (10, 4, 0)
    assert (with_tier.bytes_stored, with_tier.bytes_loaded) == (40_000, 16_000)
    assert with_tier.load_time_s == pytest.approx(0.008)
    # Time to its first token: 5 ms + 4 tokens + 8 ms of loads, against 5 ms + 20 tokens.
    assert with_tier.first_token_ns[2] - 200 * 10**9 == 17_000_000
    assert without.first_token_ns[2] - 200 * 10**9 == 25_000_000
    assert (without.combined_hit_rate, without.num_host_stores, without.bytes_loaded) == (0.0, 0, 0)


def test_a_tier_raises_the_hit_rate_when_the_working_set_overflows_the_device():
    samples = shared_prefix_requests(120, 12, 128, 16, 8, 512, seed=1)
    workload = SampleWorkload(samples, [0.05 * i for i in range(len(samples))], 512)
    # 12 prefixes of 8 blocks: 96 blocks of working set; the device holds 40, and 4
    # running requests take 36 of them: without a tier nothing hits; LRU over a
    # cycle of 12 prefixes needs most of them in the tier before any hit.
    runs = {h: simulate(workload, SimConfig(num_blocks=41, block_size=16, max_num_seqs=4, num_host_blocks=h)) for h in (0, 64, 200)}
    assert runs[0].combined_hit_rate == runs[0].prefix_cache_hit_rate
    assert runs[0].combined_hit_rate < runs[64].combined_hit_rate < runs[200].combined_hit_rate
    assert runs[200].num_host_loads > 0 and runs[200].bytes_loaded == runs[200].num_host_loads * 16 * 131072
    assert runs[200].num_finished == runs[0].num_finished == 120


def test_cli_sweeps_host_tier_sizes_and_writes_them(tmp_path: Path, capsys):
    out = tmp_path / "r.json"
    rc = main(["--dataset", "shared-prefix", "--num-requests", "40", "--num-prefixes", "8", "--prefix-len", "64",
               "--suffix-len", "16", "--output-len", "4", "--num-blocks", "30", "--kv-offloading-blocks", "0,100",
               "--offload-bandwidth-gbps", "10", "--result-json", str(out)])
    assert rc == 0
    table = capsys.readouterr().out
    assert "host hit rate" in table and "GB loaded" in table
    rows = json.loads(out.read_text())["results"]
    assert [r["num_host_blocks"] for r in rows] == [0, 100]
    assert rows[0]["bytes_loaded"] == 0 and rows[1]["num_host_loads"] > 0
    assert rows[1]["load_time_s"] == pytest.approx(rows[1]["bytes_loaded"] / 10e9)


@pytest.mark.parametrize(("argv", "message"), [
    (["--kv-offloading-blocks", "-1"], "--kv-offloading-blocks must be >= 0"),
    (["--offload-bandwidth-gbps", "0"], "--offload-bandwidth-gbps must be a positive number"),
    (["--kv-bytes-per-token", "0"], "--kv-bytes-per-token must be positive"),
    (["--kv-offloading-store", "never"], "invalid choice: 'never'"),
])
def test_cli_bad_host_tier_flags_exit_2_naming_the_problem(argv: list[str], message: str, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--dataset", "random", "--num-blocks", "100", *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_a_run_with_a_host_tier_is_its_own_line_at_both_tiers_hit_rate():
    from simulator.plot import series

    workload = sequential([PREFIX_A + [1, 2, 3, 4], PREFIX_B + [5, 6, 7, 8], PREFIX_A + [9, 9, 9, 9]])
    runs = [simulate(workload, SimConfig(num_blocks=7, block_size=BS, max_num_seqs=1, num_host_blocks=h)) for h in (0, 64)]
    assert series(runs) == {"vllm": [(7, 0.0)], "vllm + 64 host blocks": [(7, pytest.approx(16 / 60))]}


def test_write_through_stores_every_full_block_once_as_worked_out_by_hand():
    workload = sequential([PREFIX_A + [1, 2, 3, 4], PREFIX_B + [5, 6, 7, 8], PREFIX_A + [9, 9, 9, 9]])
    r = simulate(workload, SimConfig(num_blocks=7, block_size=BS, max_num_seqs=1, num_host_blocks=64, offload_store="full"))
    # A's 5 full blocks, B's 5, the third request's own suffix block: 11 stores; its 4
    # loaded prefix blocks are full again but the tier holds their hashes: 4 skipped.
    assert (r.num_host_stores, r.num_host_stores_skipped, r.num_host_loads, r.num_host_evictions) == (11, 4, 4, 0)
    assert (r.prefix_cache_hits, r.external_prefix_cache_hits) == (0, 16)


@pytest.mark.parametrize(("num_host_blocks", "store", "hits"), [(100, "eviction", True), (200, "full", True), (24, "eviction", False),
                                                            (100, "full", False)])
def test_fast_forward_with_a_host_tier_changes_nothing(num_host_blocks: int, store: str, hits: bool):
    # 12 prefixes over a 40-block device with decode stretches of 40 tokens: stores in
    # the stretches, host hits, host evictions and preemptions, stepped and fast-forwarded.
    samples = shared_prefix_requests(120, 12, 128, 16, 40, 512, seed=1)
    workload = SampleWorkload(samples, [0.05 * i for i in range(len(samples))], 512)
    cfg = dict(num_blocks=41, block_size=16, max_num_seqs=4, num_host_blocks=num_host_blocks, offload_store=store)
    fast, slow = simulate(workload, SimConfig(**cfg)), simulate(workload, SimConfig(**cfg, fast_forward=False))
    assert fast.num_fast_forwarded_steps > fast.num_steps / 4 and slow.num_fast_forwarded_steps == 0
    assert fast.num_host_stores > 0 and fast.num_host_loads > 0 and fast.num_host_evictions > 0 and fast.num_preemptions > 0
    for name in ("prefix_cache_hits", "external_prefix_cache_queries", "external_prefix_cache_hits", "num_host_stores",
                 "num_host_loads", "num_host_stores_skipped", "num_host_evictions", "num_evictions", "num_preemptions",
                 "num_steps", "simulated_s", "admit_ns", "first_token_ns", "finish_ns"):
        assert getattr(fast, name) == getattr(slow, name), name
    assert (fast.external_prefix_cache_hits > 0) == hits


def test_fast_forward_waits_when_write_through_evicts_the_heads_host_hits():
    """Found by a random search (seed 45 of 400): a plan's write-through store evicted
    the waiting head's host hits after it was tried, so it fit the next step; a
    stretch started there admitted it 2 ms late."""
    rnd = random.Random(45)
    assert [rnd.randint(10, 50), rnd.randint(1, 6), rnd.randint(8, 80), rnd.randint(1, 16), rnd.randint(3, 40)] == [27, 4, 70, 9, 8]
    samples = shared_prefix_requests(27, 4, 70, 9, 8, vocab_size=100, seed=45)
    workload = SampleWorkload(samples, [i * rnd.choice([0, 0.002, 0.01, 0.05]) for i in range(27)], 100)  # the search's arrivals
    cfg = dict(num_blocks=18, block_size=8, max_num_seqs=2, max_num_batched_tokens=8, step_overhead_ms=1.0, ms_per_token=0.01,
               num_host_blocks=21, offload_store="full", policy="forward")
    fast, slow = simulate(workload, SimConfig(**cfg)), simulate(workload, SimConfig(**cfg, fast_forward=False))
    assert fast.num_fast_forwarded_steps > 0 and fast.num_host_evictions > 0
    assert (fast.admit_ns, fast.finish_ns, fast.num_host_stores) == (slow.admit_ns, slow.finish_ns, slow.num_host_stores)
