"""The fleet simulator (simulator/fleet.py, simulator/fleet_cli.py).

* One replica behind any router is the single-engine simulator, counter for counter
  and request by request (its times), with arrivals, preemption and a host tier.
* The router sees loads as of the arrival: a burst alternates between two replicas
  under least_loaded; requests that finish before the next arrives all go to the first.
* kv_aware's index, fed by the pools' own events, ends holding exactly what each
  pool has cached; a request it routes counts as prefilling until its first token
  when streamed, until it finishes when not.
* The closed loop never has more than --max-concurrency requests in flight, and with
  room for every request it is the open loop.
* The CLI: the table, --result-json's aggregate_hit_rate per run, clear errors.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from loadgen.datasets import MooncakeRecord, SampleRequest, shared_prefix_requests
from simulator.cli import main
from simulator.config import SimConfig
from simulator.fleet import Fleet, simulate_fleet
from simulator.fleet_requests import RequestPaths
from simulator.replay import simulate
from simulator.routers import ROUTERS
from simulator.workload import SampleWorkload, TraceWorkload

TRACE = Path("/work/shared/traces/conversation_trace.jsonl")


def shared_prefix(n: int = 60, rate_gap_s: float = 0.01, output_len: int = 24) -> SampleWorkload:
    samples = shared_prefix_requests(n, 4, 96, 24, output_len, 512, seed=1)
    return SampleWorkload(samples, [i * rate_gap_s for i in range(n)], 512)


def trace_workload() -> TraceWorkload:
    # prompts of 1,200-1,600 tokens over 4 trace blocks: two shared, then one of 3, one of 4
    records = [MooncakeRecord(t * 40.0, 1200 + 100 * (t % 5), 20 + t % 7, (1, 2, t % 3 + 3, t % 4 + 10)) for t in range(30)]
    return TraceWorkload(records)


@pytest.mark.parametrize("router", ROUTERS)
@pytest.mark.parametrize(
    "make, cfg",
    [
        # small, admitting without room for the whole sequence: preemptions, evictions
        (lambda: shared_prefix(output_len=80), SimConfig(60, block_size=16, max_num_seqs=8, reserve_full_sequence=False)),
        (trace_workload, SimConfig(120, block_size=16, num_host_blocks=200)),
    ],
)
def test_one_replica_is_the_single_engine_counter_for_counter(router, make, cfg):
    workload = make()
    single = simulate(workload, cfg)
    fleet = Fleet(workload, cfg, 1, router)
    got = fleet.run()
    run = fleet.runs[0]
    assert (got.prefix_cache_hits, got.prefix_cache_queries) == (single.prefix_cache_hits, single.prefix_cache_queries)
    assert (got.num_evictions, got.num_preemptions, got.num_rejected) == (single.num_evictions, single.num_preemptions, single.num_rejected)
    assert (run.admit_ns, run.first_token_ns, run.finish_ns) == (single.admit_ns, single.first_token_ns, single.finish_ns)
    assert (run.num_steps, run.num_ff_steps) == (single.num_steps, single.num_fast_forwarded_steps)
    if run.tier is not None:
        assert (run.tier.num_stores, run.tier.num_loads) == (single.num_host_stores, single.num_host_loads)
        assert single.num_host_loads > 0  # the host tier was read
    assert got.num_finished == single.num_finished == len(workload)
    if cfg.num_blocks == 60:
        assert single.num_preemptions > 0 and single.num_evictions > 0  # the case is not trivial


def test_the_router_sees_the_loads_at_the_arrival():
    cfg = SimConfig(400, block_size=16)
    burst = shared_prefix(8, rate_gap_s=0.0)  # all at t=0: each pick raises a load
    fleet = Fleet(burst, cfg, 2, "least_loaded")
    fleet.run()
    assert fleet.routed_to == [0, 1, 0, 1, 0, 1, 0, 1]
    spaced = shared_prefix(6, rate_gap_s=10.0)  # each done long before the next: loads all 0
    fleet = Fleet(spaced, cfg, 2, "least_loaded")
    fleet.run()
    assert fleet.routed_to == [0] * 6


def test_kv_aware_index_ends_holding_what_each_pool_caches():
    workload = shared_prefix(80, rate_gap_s=0.005)
    fleet = Fleet(workload, SimConfig(50, block_size=16, max_num_seqs=6), 3, "kv_aware")
    result = fleet.run()
    fleet._deliver_events(1 << 62)
    for r, run in enumerate(fleet.runs):
        pool_hashes = set(run.kv.block_pool.cached_block_hash_to_block.keys())
        indexed = {h for h, owners in fleet.router.index.held.items() if r in owners}
        assert indexed == pool_hashes, r
        assert run.kv.block_pool.num_evictions > 0  # removals were exercised
    assert result.num_finished == 80 and sum(result.per_replica[r]["requests"] for r in range(3)) == 80


@pytest.mark.parametrize("stream, expected", [(True, 0), (False, 1)])
def test_kv_aware_counts_a_request_prefilling_until_its_first_token_or_its_end(stream: bool, expected: int):
    """Request 0 (a 128-token prefix, 16 more, 60 tokens out) goes to replica 0 (a tie:
    the first); request 1 (the same prefix, another 16) comes at 100 ms, after request
    0's first token (one 5 + 144 x 0.02 ms step) and before its end (60 steps of 5 ms).
    Replica 0 holds 8 of its blocks: 16 tokens to prefill there against 144 on replica
    1, with one request in flight. Streamed, request 0 no longer prefills: (16 + 0) x 2 =
    32 < 144, replica 0. Not streamed, it still counts its 144: (16 + 144) x 2 = 320 >
    144, replica 1."""
    prefix = list(range(1, 129))
    samples = [SampleRequest(prefix + [200 + i] * 16, 60) for i in range(2)]
    workload = SampleWorkload(samples, [0.0, 0.1], 512)
    fleet = Fleet(workload, SimConfig(100, block_size=16), 2, "kv_aware", stream=stream)
    fleet.run()
    assert fleet.routed_to == [0, expected]
    first_token, finish = fleet.runs[0].first_token_ns[0], fleet.runs[0].finish_ns[0]
    assert first_token < 100_000_000 < finish  # the premise: request 1 came between them


@pytest.mark.parametrize("concurrency", [1, 3])
def test_closed_loop_keeps_at_most_c_in_flight(concurrency: int):
    workload = shared_prefix(30, rate_gap_s=0.0)
    fleet = Fleet(workload, SimConfig(200, block_size=16), 2, "round_robin", max_concurrency=concurrency)
    result = fleet.run()
    sends = [s.arrival_ns for s in fleet.prepared.specs]
    finishes = [min(run.finish_ns[i] for run in fleet.runs if run.finish_ns[i] >= 0) for i in range(30)]
    for t in sends:  # in flight just after a send: sent by then, not finished by then
        assert sum(1 for s, f in zip(sends, finishes, strict=True) if s <= t < f) <= concurrency
    assert result.num_finished == 30
    if concurrency == 1:  # one at a time: each sent when the last finished
        assert sorted(sends)[1:] == sorted(finishes)[:-1]


def test_closed_loop_with_room_for_everyone_is_the_open_loop():
    workload = shared_prefix(40, rate_gap_s=0.002)
    cfg = SimConfig(300, block_size=16)
    open_loop = simulate_fleet(workload, cfg, 3, "cache_aware")
    closed = simulate_fleet(workload, cfg, 3, "cache_aware", max_concurrency=40)
    timing = {"wall_s": 0, "cpu_s": 0}
    assert closed.summary() | timing | {"max_concurrency": None} == open_loop.summary() | timing


def test_cli_fleet_table_and_result_json(tmp_path: Path, capsys):
    out = tmp_path / "fleet.json"
    argv = ["--dataset", "shared-prefix", "--num-requests", "40", "--num-blocks", "120", "--request-rate", "50",
            "--replicas", "1,2", "--router", "round_robin,kv_aware", "--jobs", "1", "--result-json", str(out)]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "hit rate" in table and "req max/mean" in table and "kv_aware" in table
    rows = json.loads(out.read_text())["results"]
    assert [(r["replicas"], r["router"]) for r in rows] == [(1, "round_robin"), (1, "kv_aware"), (2, "round_robin"), (2, "kv_aware")]
    for r in rows:
        assert r["aggregate_hit_rate"] == pytest.approx(r["prefix_cache_hits"] / r["prefix_cache_queries"])
        assert len(r["per_replica"]) == r["replicas"] and r["num_finished"] == 40
    assert rows[0]["aggregate_hit_rate"] == rows[1]["aggregate_hit_rate"]  # one replica: the router is moot


def test_cli_request_path_adds_its_times_to_each_request_of_a_closed_loop(tmp_path: Path):
    """One request at a time: each spends 2 + 3 ms before its engine and (but the last,
    whose way back no engine waits for) 4.5 ms after it; the engines' work is the same."""
    argv = ["--dataset", "shared-prefix", "--num-requests", "40", "--num-blocks", "120", "--replicas", "2",
            "--router", "round_robin", "--max-concurrency", "1", "--jobs", "1"]
    spans = []
    for extra in ([], ["--request-path-ms", "2,3,4.5"], ["--request-path-ms", "2,3,4.5", "--request-path-jitter", "0.5"]):
        out = tmp_path / f"fleet{len(spans)}.json"
        assert main([*argv, *extra, "--result-json", str(out)]) == 0
        (row,) = json.loads(out.read_text())["results"]
        spans.append(row["simulated_s"])
    assert spans[1] - spans[0] == pytest.approx(40 * 0.005 + 39 * 0.0045, abs=1e-9)
    assert spans[2] != spans[1]  # drawn apart, the sum moves


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--router", "kv_aware"], "--router applies to fleet runs"),
        (["--max-concurrency", "4"], "--max-concurrency applies to fleet runs"),
        (["--jobs", "2"], "--jobs applies to fleet runs"),
        (["--non-streaming"], "--non-streaming applies to fleet runs"),
        (["--replicas", "0"], "--replicas must be positive"),
        (["--replicas", "2", "--router", "random"], "unknown router 'random'"),
        (["--replicas", "2", "--max-concurrency", "0"], "--max-concurrency must be >= 1"),
        (["--replicas", "2", "--jobs", "0"], "--jobs must be >= 1"),
        (["--replicas", "2", "--plot", "x.png"], "--plot draws single-engine runs"),
        (["--request-path-ms", "1,2,3"], "--request-path-ms applies to fleet runs"),
        (["--replicas", "2", "--request-path-ms", "1,2"], "expected DECIDE,THERE,BACK"),
        (["--replicas", "2", "--request-path-ms", "1,-2,3"], "expected DECIDE,THERE,BACK"),
        (["--replicas", "2", "--request-path-ms", "1,x,3"], "expected DECIDE,THERE,BACK"),
        (["--replicas", "2", "--request-path-jitter", "0.5"], "--request-path-jitter needs --request-path-ms"),
        (["--replicas", "2", "--request-path-ms", "1,2,3", "--request-path-jitter", "1"], "must be in [0, 1)"),
    ],
)
def test_cli_fleet_flag_errors(argv: list[str], message: str, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--num-blocks", "100", *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_trace_routing_units_are_its_blocks_weighted_by_their_tokens():
    from simulator.fleet_requests import routing_units

    records = [MooncakeRecord(0.0, 1100, 3, (5, 6, 7)), MooncakeRecord(1.0, 1024, 3, (5, 6)), MooncakeRecord(2.0, 600, 3, (9, 6))]
    w = TraceWorkload(records)
    (a, wa), (b, wb), (c, wc) = (routing_units(w, i, []) for i in range(3))
    assert (wa, wb, wc) == ([512, 512, 76], [512, 512], [512, 88])
    assert b == a[:2] and c[0] != a[0] and c[1] != a[1]  # equal prefix, equal units; 6 after 9 is another prefix


def test_a_request_reaches_its_engine_after_the_path_and_the_client_sends_after_the_way_back():
    """One at a time through the closed loop: each request is sent when the client sees
    the last one's end (``back`` after the engine's), decided ``decide`` later, and
    reaches its engine ``there`` after that."""
    paths = RequestPaths.from_ms(2.0, 3.0, 4.5)
    fleet = Fleet(shared_prefix(12, rate_gap_s=0.0), SimConfig(200, block_size=16), 2, "round_robin",
                  max_concurrency=1, paths=paths)
    result = fleet.run()
    arrivals = sorted(s.arrival_ns for s in fleet.prepared.specs)
    finishes = sorted(f for run in fleet.runs for f in run.finish_ns if f >= 0)
    assert result.num_finished == 12
    assert arrivals[0] == 2_000_000 + 3_000_000  # the first send at 0
    assert arrivals[1:] == [f + 4_500_000 + 2_000_000 + 3_000_000 for f in finishes[:-1]]


@pytest.mark.parametrize("back_ms, expected", [(50.0, 0), (95.0, 1)])
def test_kv_aware_sees_a_first_token_only_once_it_is_back(back_ms: float, expected: int):
    """The streamed case of the test above: request 0's first token comes at 7.88 ms (one
    5 + 144 x 0.02 ms step). Seen 50 ms later, before request 1's decision at 100 ms:
    request 0 no longer prefills, replica 0 (32 < 144). Seen 95 ms later, after it:
    (16 + 144) x 2 = 320 > 144, replica 1."""
    prefix = list(range(1, 129))
    samples = [SampleRequest(prefix + [200 + i] * 16, 60) for i in range(2)]
    workload = SampleWorkload(samples, [0.0, 0.1], 512)
    fleet = Fleet(workload, SimConfig(100, block_size=16), 2, "kv_aware", paths=RequestPaths.from_ms(0.0, 0.0, back_ms))
    fleet.run()
    assert fleet.routed_to == [0, expected]
    assert fleet.runs[0].first_token_ns[0] == 7_880_000  # the premise


def test_jittered_paths_are_drawn_per_request_within_the_bounds_and_followed():
    paths = RequestPaths.from_ms(2.0, 3.0, 4.0, jitter=0.5, seed=3)
    draws = paths.draw(12)
    assert draws == paths.draw(12) != RequestPaths.from_ms(2.0, 3.0, 4.0, jitter=0.5, seed=4).draw(12)
    for mean, column in zip((2e6, 3e6, 4e6), zip(*draws, strict=True), strict=True):
        assert all(0.5 * mean <= v <= 1.5 * mean for v in column) and len(set(column)) == 12
    fleet = Fleet(shared_prefix(12, rate_gap_s=0.0), SimConfig(200, block_size=16), 2, "round_robin",
                  max_concurrency=1, paths=paths)
    fleet.run()
    arrival = [s.arrival_ns for s in fleet.prepared.specs]
    finish = [max(run.finish_ns[i] for run in fleet.runs) for i in range(12)]
    order = sorted(range(12), key=arrival.__getitem__)
    assert arrival[order[0]] == draws[order[0]][0] + draws[order[0]][1]
    for prev, i in itertools.pairwise(order):  # one at a time: sent when the last one's end is back
        assert arrival[i] == finish[prev] + draws[prev][2] + draws[i][0] + draws[i][1]
