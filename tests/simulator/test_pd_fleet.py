"""The P/D fleet (simulator/pd_fleet.py, simulator/pd_transfer.py, simulator/pd_args.py).

Times by hand, with the default cost model (5 ms a step + 0.02 ms a token) and the default
KV bytes (131,072 a token: 2,097,152 a 16-token block; 1 GB/s = 1 byte/ns). A prompt of
161 tokens is 10 full blocks and its last token, 11 blocks: the decode engine reads all 11
(the partial one too, as vLLM's) and computes the last token again.

* TTFT = the prefill step (5 + 161 x 0.02 = 8.22 ms) + the read (1 ms + 11 blocks /
  bandwidth) + the decode step that computes the last token and samples (5.02 ms).
* The prefill engine lends a request's blocks until the read ends, then frees them all.
* A decode engine's own prefix-cache hits are not read (full blocks: the last, partial
  one is read even when the rest hit).
* Two prefill engines prefill two requests at once where one prefills one at a time.
* Every request gets its output_len tokens, as in a plain fleet; fast-forward changes no time.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from loadgen.datasets import SampleRequest, shared_prefix_requests
from simulator.cli import main
from simulator.config import SimConfig
from simulator.fleet import Fleet
from simulator.pd_fleet import PDFleet
from simulator.workload import SampleWorkload

BLOCK_BYTES = 2_097_152
PREFILL_NS = 8_220_000  # 5 ms + 161 x 0.02 ms
DECODE_FIRST_NS = 5_020_000  # 5 ms + 1 token


def prompt(seed: int, n: int = 161) -> list[int]:
    return [2 + (seed * 131 + j * 7) % 500 for j in range(n)]


def workload(prompts: list[list[int]], arrivals_s: list[float], output_len: int = 4) -> SampleWorkload:
    return SampleWorkload([SampleRequest(p, output_len) for p in prompts], arrivals_s, 512)


@pytest.mark.parametrize("gbps, read_ns", [(1.0, 23_068_672), (2.0, 11_534_336), (4.0, 5_767_168)])
def test_ttft_is_the_prefill_the_read_at_the_bandwidth_and_one_decode_step(gbps: float, read_ns: int):
    fleet = PDFleet(workload([prompt(0)], [0.0]), SimConfig(200), 1, 1, transfer_gbps=gbps, transfer_latency_ms=1.0)
    got = fleet.run()
    assert fleet.tokens.first_ns == [PREFILL_NS + 1_000_000 + read_ns + DECODE_FIRST_NS]
    x = got.pd_pools["transfer"]
    assert (x["transfers"], x["blocks"], x["bytes"]) == (1, 11, 11 * BLOCK_BYTES)
    assert x["busy_s"] == pytest.approx((1_000_000 + read_ns) / 1e9)


def test_the_prefill_engine_holds_the_blocks_until_the_read_ends_then_frees_them():
    # 11 blocks (and the null one): a 161-token prompt and its sampled token fill them; the
    # second request waits for the first's read to end (8.22 + 1 + 11.53 ms), not its prefill.
    fleet = PDFleet(workload([prompt(0), prompt(1)], [0.0, 0.001]), SimConfig(12), 1, 1)
    fleet.run()
    prefill = fleet.prefill[0].run
    assert prefill.admit_ns == [0, PREFILL_NS + 1_000_000 + 11_534_336]
    for e in (*fleet.prefill, *fleet.decode):
        assert e.run.kv.usage == 0.0 and not e.run.kv.req_to_blocks
        e.run.kv.check_invariants()
    assert not fleet.prefill[0].run.sched.kv_transfer.lent and fleet.prefill[0].run.sched.kv_transfer.num_sent == 2


def test_a_decode_engines_own_hits_are_not_read():
    # The second prompt shares the first's first 6 blocks: 5 read; the third is the first
    # again: its 10 full blocks hit, its last (partial) block read.
    second = prompt(0)[:96] + prompt(2)[96:]
    fleet = PDFleet(workload([prompt(0), second, prompt(0)], [0.0, 1.0, 2.0]), SimConfig(200), 1, 1)
    got = fleet.run()
    x = got.pd_pools["transfer"]
    assert (x["transfers"], x["blocks"], x["bytes"]) == (3, 11 + 5 + 1, 17 * BLOCK_BYTES)
    decode = got.pd_pools["decode"][0]
    assert decode["prefix_cache_hits"] == 96 + 160  # the third hits up to its last token
    # The third's first token: its prefill (one token, the rest hit there), one block's read, a decode step.
    assert fleet.tokens.first_ns[2] - fleet.send_ns[2] == PREFILL_NS - 160 * 20_000 + 1_000_000 + 1_048_576 + DECODE_FIRST_NS


def test_two_prefill_engines_prefill_two_requests_at_once():
    # A step's budget is one prompt; the link is fast, so the prefill pool is what waits.
    cfg = SimConfig(200, max_num_batched_tokens=161)
    burst = workload([prompt(k) for k in range(4)], [0.0] * 4)
    one = PDFleet(burst, cfg, 1, 1, transfer_gbps=1000.0, transfer_latency_ms=0.0)
    one.run()
    two = PDFleet(burst, cfg, 2, 1, transfer_gbps=1000.0, transfer_latency_ms=0.0)
    two.run()
    assert one.prefill[0].run.admit_ns == [0, PREFILL_NS, 2 * PREFILL_NS, 3 * PREFILL_NS]
    assert [e.peak_running for e in one.prefill] == [1]
    admitted = [max(e.run.admit_ns[i] for e in two.prefill) for i in range(4)]
    assert admitted == [0, 0, PREFILL_NS, PREFILL_NS]
    assert [e.peak_running for e in two.prefill] == [1, 1]
    assert two.tokens.first_ns[1] < one.tokens.first_ns[1] and two.tokens.first_ns[3] < one.tokens.first_ns[3]


@pytest.mark.parametrize("layout, concurrency", [((1, 1), None), ((2, 1), None), ((1, 2), 6)])
def test_every_request_gets_its_tokens_as_in_a_plain_fleet_and_fast_forward_moves_no_time(layout, concurrency):
    samples = shared_prefix_requests(40, 4, 96, 40, 100, 512, seed=3)
    w = SampleWorkload(samples, [i * 0.004 for i in range(40)], 512)
    cfg = SimConfig(400, max_num_batched_tokens=512)
    plain = Fleet(w, cfg, 1, "round_robin")
    plain.run()
    fleet = PDFleet(w, cfg, *layout, "least_loaded", max_concurrency=concurrency)
    got = fleet.run()
    assert fleet.tokens.num_tokens == plain.tokens.num_tokens == [100] * 40
    assert got.num_finished == 40 and got.num_output_tokens == 4000
    stepped = PDFleet(w, dataclasses.replace(cfg, fast_forward=False), *layout, "least_loaded", max_concurrency=concurrency)
    stepped.run()
    assert (stepped.tokens.first_ns, stepped.tokens.last_ns) == (fleet.tokens.first_ns, fleet.tokens.last_ns)
    assert stepped.tokens.gaps == fleet.tokens.gaps
    assert sum(e.run.num_ff_steps for e in fleet.decode) > 0  # the stretches ran


def test_cli_pd_rows_beside_one_engine(tmp_path: Path, capsys):
    out = tmp_path / "pd.json"
    argv = ["--dataset", "random", "--num-requests", "20", "--input-len", "300", "--output-len", "8", "--num-blocks", "400",
            "--request-rate", "20", "--replicas", "1", "--pd", "1:1,2:1", "--router", "round_robin", "--jobs", "1",
            "--transfer-gbps", "4", "--result-json", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "1P1D" in printed and "2P1D" in printed and "p99 TTFT ms" in printed and "transfers 20" in printed
    rows = json.loads(out.read_text())["results"]
    assert [(r["replicas"], r["pd"]) for r in rows] == [(1, ""), (2, "1:1"), (3, "2:1")]
    for r in rows[1:]:
        assert r["pd_pools"]["transfer"]["gbps"] == 4.0 and r["num_finished"] == 20
        assert all(e["end_usage"] == 0.0 for e in r["pd_pools"]["prefill"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--transfer-gbps", "2"], "--transfer-gbps applies to P/D fleets"),
        (["--pd", "0:1"], "expected P:D"),
        (["--pd", "1-1"], "expected P:D"),
        (["--pd", "1:1", "--transfer-gbps", "0"], "--transfer-gbps must be a positive number"),
        (["--pd", "1:1", "--router", "kv_aware"], "without --router kv_aware"),
        (["--pd", "1:1", "--num-speculative-tokens", "2"], "without --num-speculative-tokens"),
    ],
)
def test_cli_pd_flag_errors(argv: list[str], message: str, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--num-blocks", "100", *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_the_engines_drive_the_real_connector_and_a_request_refused_for_decode_frees_its_lend():
    # max_model_len 164: the prefill leg (161 + 1 token) fits, the second's decode leg (161 + 4) is refused.
    w = SampleWorkload([SampleRequest(prompt(0), 3), SampleRequest(prompt(1), 4)], [0.0, 1.0], 512)
    fleet = PDFleet(w, SimConfig(200, max_model_len=164), 1, 1)
    got = fleet.run()
    producer, consumer = fleet.prefill[0].run.sched.kv_transfer, fleet.decode[0].run.sched.kv_transfer
    assert (producer.num_lent, producer.num_sent, producer.lent) == (2, 2, {})
    # The decode engine pulled the first's whole prompt (11 blocks) and counts it as vLLM's connector does.
    assert (consumer.num_pulls, consumer.num_pull_blocks, consumer.num_pull_tokens) == (1, 11, 161)
    assert fleet.decode[0].run.kv.external_prefix_cache_stats.hits == 161
    assert got.num_rejected == 1 and fleet.tokens.num_tokens == [3, 0]
    assert fleet.prefill[0].run.kv.usage == 0.0
