"""The simulator with an external tier (the scheduler's own ExternalTier and parking, the
worker's I/O simulated): hits, loads and saves against figures worked out by hand; the
tier raises the hit rate when the working set overflows the device; read bandwidth, a
bounded store and a warm start move the figures the way they must; fast-forward changes
nothing; a Mooncake trace runs through the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadgen.datasets import SampleRequest, shared_prefix_requests
from simulator.cli import main
from simulator.config import SimConfig
from simulator.external_store import SimulatedStore
from simulator.replay import simulate
from simulator.workload import SampleWorkload

TRACE = Path("/work/shared/traces/conversation_trace.jsonl")
BS = 4
PREFIX_A, PREFIX_B = list(range(10, 26)), list(range(40, 56))  # 16 tokens: 4 blocks each
# 1,000 KV bytes a token: 4,000 a block; 4 blocks at 0.002 GB/s read in 8 ms. Staging a save
# (device to host, --offload-bandwidth-gbps) is made free here, and tested on its own.
HAND = dict(num_blocks=7, block_size=BS, max_num_seqs=1, step_overhead_ms=5.0, ms_per_token=1.0, kv_bytes_per_token=1000,
            offload_bandwidth_gbps=1e6)
DISK = dict(external_tier="disk", external_read_gbps=0.002, external_write_gbps=1.0, external_latency_ms=0.0)


def sequential(prompts: list[list[int]], output_len: int = 2) -> SampleWorkload:
    """One request every 100 virtual seconds: each is over before the next arrives."""
    return SampleWorkload([SampleRequest(p, output_len) for p in prompts], [100.0 * i for i in range(len(prompts))], 512)


def overflowing(output_len: int = 8) -> SampleWorkload:
    # 12 prefixes of 8 blocks: 96 blocks of working set; the device holds 40, and 4
    # running requests take 36 of them: the device alone hits nothing.
    samples = shared_prefix_requests(120, 12, 128, 16, output_len, 512, seed=1)
    return SampleWorkload(samples, [0.05 * i for i in range(len(samples))], 512)


OVERFLOW = dict(num_blocks=41, block_size=16, max_num_seqs=4)


def test_a_prefix_saved_to_the_tier_is_loaded_back_as_worked_out_by_hand():
    # A, B, then A's prefix again (as tests/simulator/test_offload_sim.py): 6 device blocks,
    # so B evicts A's blocks and the third request finds its 4 prefix blocks only in the tier.
    workload = sequential([PREFIX_A + [1, 2, 3, 4], PREFIX_B + [5, 6, 7, 8], PREFIX_A + [9, 9, 9, 9]])
    r, without = simulate(workload, SimConfig(**HAND, **DISK)), simulate(workload, SimConfig(**HAND))
    assert (r.prefix_cache_queries, r.prefix_cache_hits, r.external_tier_hit_tokens) == (60, 0, 16)
    assert r.external_tier_hit_rate == r.combined_hit_rate == pytest.approx(16 / 60)
    assert (r.external_prefix_cache_queries, r.external_prefix_cache_hits) == (60, 16)
    # Write-through: A's 5 full blocks, B's 5, the third's suffix block; its 4 loaded blocks are held already.
    assert (r.external_tier_blocks_saved, r.external_tier_saves_skipped) == (11, 4)
    assert (r.external_tier_loads, r.external_tier_blocks_loaded, r.external_tier_load_failures, r.external_tier_evictions) == (1, 4, 0, 0)
    assert (r.external_tier_bytes_read, r.external_tier_bytes_written) == (16_000, 44_000)
    assert r.external_tier_mean_load_ms == pytest.approx(8.0)
    # The third request waits 8 ms for its load, then computes 4 tokens (5 + 4 ms), against 5 + 20 ms.
    assert r.first_token_ns[2] - 200 * 10**9 == 17_000_000
    assert without.first_token_ns[2] - 200 * 10**9 == 25_000_000
    assert r.num_finished == 3 and without.external_tier == "none"


def test_staging_the_saves_is_charged_on_the_step_path():
    # One 20-token prompt, 2 tokens out: 25 ms of prefill and 6 of decode; its 5 full blocks are
    # saved, each staged (copied to the host) in 1 ms at 0.004 GB/s, in the step of the plan that saves it.
    workload = sequential([PREFIX_A + [1, 2, 3, 4]])
    r = simulate(workload, SimConfig(**{**HAND, "offload_bandwidth_gbps": 0.004}, **DISK))
    assert r.external_tier_blocks_saved == 5 and r.external_tier_stage_s == pytest.approx(0.005)
    assert r.finish_ns[0] == 36_000_000
    # The write itself is off the step path: 5 x 4,000 bytes at 1 GB/s on the I/O thread.
    assert r.external_tier_save_s == pytest.approx(20e-6)


def test_the_tier_raises_the_hit_rate_when_the_working_set_overflows_the_device():
    workload = overflowing()
    without, disk = simulate(workload, SimConfig(**OVERFLOW)), simulate(workload, SimConfig(**OVERFLOW, external_tier="disk"))
    assert without.combined_hit_rate == without.prefix_cache_hit_rate == 0.0
    assert disk.combined_hit_rate > 0.5 and disk.external_tier_hit_rate == disk.combined_hit_rate - disk.prefix_cache_hit_rate
    assert disk.external_tier_bytes_read == disk.external_tier_blocks_loaded * 16 * 131072 > 0
    assert disk.num_finished == without.num_finished == 120
    assert "external_tier_hit_rate" in disk.summary() and not any(k.startswith("external_tier") for k in without.summary())


def test_a_slower_read_bandwidth_makes_the_first_tokens_later_with_the_same_hits():
    workload = overflowing()
    fast, slow = (simulate(workload, SimConfig(**OVERFLOW, external_tier="disk", external_read_gbps=g)) for g in (3.0, 0.3))
    assert slow.external_tier_hit_tokens == fast.external_tier_hit_tokens > 0
    assert slow.external_tier_mean_load_ms > 5 * fast.external_tier_mean_load_ms
    assert slow.mean_ttft_ms > 2 * fast.mean_ttft_ms


def test_a_bounded_store_evicts_and_finds_less():
    workload = overflowing()
    runs = {n: simulate(workload, SimConfig(**OVERFLOW, external_tier="store", external_tier_blocks=n)) for n in (0, 64)}
    assert runs[0].external_tier_evictions == 0 and runs[64].external_tier_evictions > 0
    assert runs[64].external_tier_hit_tokens < runs[0].external_tier_hit_tokens
    # Evicted keys reach the scheduler's index: it saves them again when they are computed again.
    assert runs[64].external_tier_blocks_saved > runs[0].external_tier_blocks_saved


def test_the_store_evicts_the_least_recently_used():
    store = SimulatedStore(2)
    assert store.put("a", 1) == [] and store.put("b", 1) == []
    assert store.get("a") == 1  # a is used: b is the least recent
    assert store.put("c", 1) == ["b"] and store.keys() == ["a", "c"] and store.get("b") is None
    assert SimulatedStore(0).put("x", 1) == [] and store.num_evictions == 1


def test_a_warm_start_finds_the_first_requests_prefixes_in_the_tier():
    workload = sequential([PREFIX_A + [1, 2, 3, 4], PREFIX_B + [5, 6, 7, 8], PREFIX_A + [9, 9, 9, 9]])
    cold, warm = simulate(workload, SimConfig(**HAND, **DISK)), simulate(workload, SimConfig(**HAND, **DISK, external_warm=True))
    # The first replay left 11 blocks; each request finds its 4 prefix blocks, the first one too.
    assert (warm.external_tier_warm, warm.external_tier_warm_blocks, cold.external_tier_warm_blocks) == (True, 11, 0)
    assert (warm.external_tier_hit_tokens, warm.external_tier_loads, warm.external_tier_blocks_saved) == (48, 3, 0)
    assert [t - 100 * 10**9 * i for i, t in enumerate(warm.first_token_ns)] == [17_000_000] * 3
    assert cold.first_token_ns[0] == 25_000_000


@pytest.mark.parametrize("blocks", [0, 48])
def test_fast_forward_with_an_external_tier_changes_nothing(blocks: int):
    # Decode stretches of 40 tokens save a block every 16 steps per request; loads, and with a bound, evictions.
    workload = overflowing(output_len=40)
    cfg = dict(**OVERFLOW, external_tier="disk", external_tier_blocks=blocks, external_write_gbps=0.05)
    fast, slow = simulate(workload, SimConfig(**cfg)), simulate(workload, SimConfig(**cfg, fast_forward=False))
    # NOTE: with a bound a stretch needs an empty waiting queue (simulator/external_worker.py): fewer of them.
    assert fast.num_fast_forwarded_steps > (50 if blocks else fast.num_steps / 4) and slow.num_fast_forwarded_steps == 0
    assert fast.external_tier_blocks_loaded > 0 and (fast.external_tier_evictions > 0) == bool(blocks)
    for name in ("prefix_cache_hits", "external_tier_hit_tokens", "external_tier_blocks_loaded", "external_tier_blocks_saved",
                 "external_tier_evictions", "external_tier_stage_s", "external_tier_peak_backlog_s", "num_evictions",
                 "num_preemptions", "num_steps", "simulated_s", "admit_ns", "first_token_ns", "finish_ns"):
        assert getattr(fast, name) == getattr(slow, name), name


def test_a_request_back_from_a_load_does_not_block_a_preempted_one_forever():
    # Found by a search over small pools: 4 requests of one 24-token prefix on 9 blocks (the device alone finishes them).
    samples = shared_prefix_requests(4, 1, 24, 4, 8, vocab_size=100, seed=0)
    workload = SampleWorkload(samples, [0.0] * 4, 100)
    cfg = dict(num_blocks=10, block_size=4, max_num_seqs=4)
    assert simulate(workload, SimConfig(**cfg)).num_finished == 4
    assert simulate(workload, SimConfig(**cfg, external_tier="disk")).num_finished == 4


@pytest.mark.skipif(not TRACE.is_file(), reason=f"{TRACE} not here")
def test_cli_replays_a_mooncake_trace_with_the_store_tier(tmp_path: Path, capsys):
    out = tmp_path / "r.json"
    rc = main(["--trace", str(TRACE), "--num-requests", "150", "--time-scale", "0.5", "--num-blocks", "6000",
               "--external-tier", "store", "--external-tier-blocks", "0,2000", "--result-json", str(out)])
    assert rc == 0
    captured = capsys.readouterr()
    assert "ext hit rate" in captured.out and "GB read" in captured.out and "store tier unbounded" in captured.err
    unbounded, bounded = json.loads(out.read_text())["results"]
    assert (unbounded["external_tier"], unbounded["external_tier_blocks"], bounded["external_tier_blocks"]) == ("store", 0, 2000)
    assert unbounded["external_tier_hit_rate"] > 0 and unbounded["external_tier_bytes_read"] > 0 and unbounded["external_tier_mean_load_ms"] > 0
    assert unbounded["combined_hit_rate"] > unbounded["prefix_cache_hit_rate"]
    assert bounded["external_tier_evictions"] > 0 and bounded["external_tier_hit_tokens"] < unbounded["external_tier_hit_tokens"]
    assert unbounded["num_finished"] + unbounded["num_rejected"] == bounded["num_finished"] + bounded["num_rejected"] == 150


@pytest.mark.parametrize(("argv", "message"), [
    (["--external-read-gbps", "2"], "--external-read-gbps need --external-tier disk or store"),
    (["--external-tier-warm"], "--external-tier-warm need --external-tier disk or store"),
    (["--external-tier", "disk", "--external-tier-blocks", "-1"], "--external-tier-blocks must be >= 0"),
    (["--external-tier", "disk", "--external-write-gbps", "0"], "--external-write-gbps must be a positive number"),
    (["--external-tier", "store", "--external-latency-ms", "-1"], "--external-latency-ms must be >= 0"),
    (["--external-tier", "disk", "--replicas", "2"], "--external-tier runs with one engine"),
])
def test_cli_refuses_what_the_external_tier_cannot_take(argv: list[str], message: str, capsys):
    with pytest.raises(SystemExit):
        main(["--dataset", "random", "--num-blocks", "100", *argv])
    assert message in capsys.readouterr().err
