"""The P/D fleet (simulator/pd_fleet.py) with hybrid KV-cache groups: the prefill engine
lends every group's blocks, a sliding group's in-window tail (scheduler/sched/pd_remote_blocks.py),
and the decode engine pulls one block per (group, position) it fills, each one group's bytes.

The workload: block size 4, windows (8, 8, 0) (two sliding groups of window 8, one full
group), three layers, one a group, so a block spans one layer: 3000 bytes a token over the
three layers -> a block of 4 tokens is 4000 bytes (one group of the three layers: 12000).
P is a 22-token prompt: 5 full blocks and 2 tokens, 6 positions (0-5).

* The prefill engine computes P in one step and lends the full group's 6 blocks and each
  sliding group's last cdiv(8, 4) + 1 = 3 (positions 3-5).
* The decode engine has no hit: it admits 22 external tokens; its sliding groups hold only
  the window of token 21 (tokens 14-21: positions 3-5; 0-2 null), so it fills 6 + 3 + 3 =
  12 blocks: 12 x 4000 = 48000 bytes, read in 1 ms + 48000 / 2 ns = 1.024 ms.
* TTFT = the prefill step (5 + 22 x 0.02 = 5.44 ms) + the read + the decode step that
  computes the last token again (5.02 ms) = 11.484 ms.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from loadgen.datasets import SampleRequest
from simulator.cli import main
from simulator.config import SimConfig
from simulator.pd_fleet import PDFleet
from simulator.workload import SampleWorkload

P = list(range(10, 32))
HYBRID = SimConfig(64, 4, max_num_seqs=4, max_num_batched_tokens=64, group_windows=(8, 8, 0), num_layers=3, num_block_layers=1,
                   kv_bytes_per_token=3000)
PREFILL_NS = 5_440_000  # 5 ms + 22 x 0.02 ms
DECODE_FIRST_NS = 5_020_000  # 5 ms + 1 token


def workload(prompts: list[list[int]], output_len: int = 5) -> SampleWorkload:
    return SampleWorkload([SampleRequest(p, output_len) for p in prompts], [1.0 * i for i in range(len(prompts))], 600)


def check_engines(fleet: PDFleet) -> None:
    for e in (*fleet.prefill, *fleet.decode):
        assert e.run.kv.usage == 0.0 and not e.run.kv.req_to_blocks
        e.run.kv.check_invariants()


def test_the_decode_engine_pulls_the_full_groups_blocks_and_each_sliding_groups_tail():
    fleet = PDFleet(workload([P]), HYBRID, 1, 1)
    got = fleet.run()
    x = got.pd_pools["transfer"]
    assert (x["transfers"], x["blocks"], x["bytes"]) == (1, 6 + 3 + 3, 12 * 4000)
    assert x["busy_s"] == pytest.approx(1_024_000 / 1e9)
    consumer = fleet.decode[0].run.sched.kv_transfer
    # Hit tokens are the prompt's 22 tokens, not 12 blocks of 4.
    assert (consumer.num_pulls, consumer.num_pull_blocks, consumer.num_pull_tokens) == (1, 12, 22)
    assert fleet.decode[0].run.kv.external_prefix_cache_stats.hits == 22
    assert fleet.tokens.num_tokens == [5] and got.num_finished == 1 and got.num_output_tokens == 5
    assert fleet.tokens.first_ns == [PREFILL_NS + 1_024_000 + DECODE_FIRST_NS]
    producer = fleet.prefill[0].run.sched.kv_transfer
    assert (producer.num_lent, producer.num_sent, producer.lent) == (1, 1, {})
    check_engines(fleet)


def test_one_group_moves_whole_model_blocks():
    # The same prompt with one full-attention group of the three layers: 6 blocks of 12000 bytes.
    one = dataclasses.replace(HYBRID, group_windows=(), num_layers=0, num_block_layers=0)
    fleet = PDFleet(workload([P]), one, 1, 1)
    x = fleet.run().pd_pools["transfer"]
    assert (x["blocks"], x["bytes"]) == (6, 6 * 12000)
    check_engines(fleet)


def test_a_revisit_hits_on_the_decode_engine_in_every_group_and_pulls_the_last_position():
    # R1 is P again, after R0 ended. The decode engine cached R0's full blocks 0-4 and each
    # sliding group's 3-4 (the window of token 19, the last a hit may reach: 21 // 4 = 5
    # blocks): a 20-token hit; the 2 tokens left are position 5 of each group, 3 blocks.
    # The prefill engine hits the same 20 tokens and computes 2: 5.04 ms; the read 1 ms + 12000 / 2 ns.
    fleet = PDFleet(workload([P, P]), HYBRID, 1, 1)
    got = fleet.run()
    x = got.pd_pools["transfer"]
    assert (x["transfers"], x["blocks"], x["bytes"]) == (2, 12 + 3, 15 * 4000)
    decode = fleet.decode[0].run.kv
    assert (decode.prefix_cache_stats.hits, decode.prefix_cache_stats.queries) == (20, 44)
    assert decode.external_prefix_cache_stats.hits == 22 + 2
    assert fleet.decode[0].run.sched.kv_transfer.num_pull_blocks == 15
    assert fleet.tokens.num_tokens == [5, 5]
    assert fleet.tokens.first_ns[1] - fleet.send_ns[1] == 5_040_000 + 1_006_000 + DECODE_FIRST_NS
    check_engines(fleet)


def test_a_model_of_sliding_layers_only_pulls_the_window_of_the_last_prompt_token():
    # One sliding group of the three layers (window 8): a block is 12000 bytes. No full group
    # gives the prompt's length: remote_num_tokens (22) does, 6 positions; the decode engine
    # fills positions 3-5 (the window of token 21, computed again), 3 blocks: 36000 bytes,
    # read in 1 ms + 36000 / 2 ns = 1.018 ms.
    sliding = dataclasses.replace(HYBRID, group_windows=(8,), num_layers=3, num_block_layers=3)
    fleet = PDFleet(workload([P]), sliding, 1, 1)
    got = fleet.run()
    x = got.pd_pools["transfer"]
    assert (x["transfers"], x["blocks"], x["bytes"]) == (1, 3, 3 * 12000)
    consumer = fleet.decode[0].run.sched.kv_transfer
    assert (consumer.num_pulls, consumer.num_pull_blocks, consumer.num_pull_tokens, consumer.num_refused_pulls) == (1, 3, 22, 0)
    assert fleet.tokens.num_tokens == [5] and got.num_finished == 1
    assert fleet.tokens.first_ns == [PREFILL_NS + 1_018_000 + DECODE_FIRST_NS]
    check_engines(fleet)


CLI = ["--dataset", "random", "--num-requests", "6", "--input-len", "22", "--range-ratio", "0", "--output-len", "5",
       "--num-blocks", "64", "--block-size", "4", "--request-rate", "inf", "--jobs", "1", "--kv-bytes-per-token", "3000"]


def test_cli_pd_runs_hybrid_groups(tmp_path: Path, capsys):
    # --layer-windows 8,8,0: the three groups above. The random prompts share no block, so
    # each request pulls 12 blocks of 4000 bytes, as P above.
    out = tmp_path / "pd.json"
    assert main([*CLI, "--layer-windows", "8,8,0", "--pd", "1:1", "--result-json", str(out)]) == 0
    assert "transfers 6" in capsys.readouterr().out
    (row,) = json.loads(out.read_text())["results"]
    x = row["pd_pools"]["transfer"]
    assert (row["num_finished"], row["num_output_tokens"]) == (6, 30)
    assert (x["transfers"], x["blocks"], x["bytes"]) == (6, 6 * 12, 6 * 12 * 4000)

