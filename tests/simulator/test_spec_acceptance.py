"""The simulator's speculative decoding (--num-speculative-tokens, --spec-acceptance-rate;
simulator/spec_decode.py): the real scheduler verifies drafts accepted at a given rate.

* A = 0: every draft is rejected; outputs are those of a run without speculation, and the
  drafts cost their tokens: exactly (output_len - 1) x K x per-token more for one request.
* A = 1: every draft is accepted; one request of known length takes the steps counted
  by hand, 1 + ceil((output_len - 1) / (K + 1)), in the virtual time counted by hand.
* 0 < A < 1 over many requests: the measured per-token acceptance is A, the draft
  acceptance rate (A + ... + A^K) / K, within a loose bound (fixed seed).
* The CLI: the flags, the table's and --result-json's figures, clear refusals.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from loadgen.datasets import SampleRequest
from scheduler.sched.request import Request
from scheduler.sched.scheduler import Scheduler
from simulator.cli import main
from simulator.config import SimConfig
from simulator.fleet import simulate_fleet
from simulator.replay import simulate
from simulator.spec_decode import REJECTED_DRAFT, AcceptanceDrafter, num_accepted
from simulator.workload import SampleWorkload

OVERHEAD_NS, PER_TOKEN_NS = 5_000_000, 20_000  # SimConfig's defaults: 5 ms + 0.02 ms a token


def _workload(prompt_lens: list[int], output_lens: list[int], gap_s: float = 0.0, seed: int = 0) -> SampleWorkload:
    """Prompts of distinct random tokens (no shared prefix), arriving gap_s apart."""
    rng = random.Random(seed)
    samples = [SampleRequest([rng.randrange(2, 512) for _ in range(p)], n) for p, n in zip(prompt_lens, output_lens, strict=True)]
    return SampleWorkload(samples, [i * gap_s for i in range(len(samples))], 512)


def _run(workload: SampleWorkload, monkeypatch, **cfg):
    """simulate(), with every Request the scheduler was given (to read their outputs)."""
    requests: list[Request] = []
    add = Scheduler.add_request

    def recording_add(self, request):
        requests.append(request)
        add(self, request)

    monkeypatch.setattr(Scheduler, "add_request", recording_add)
    result = simulate(workload, SimConfig(**cfg), on_end=lambda s: s.kv_cache_manager.check_invariants())
    monkeypatch.setattr(Scheduler, "add_request", add)
    return result, sorted(requests, key=lambda r: r.seq_id)


def _outputs(requests: list[Request]) -> list[list[int]]:
    return [list(r.output_token_ids) for r in requests]


def _assert_complete(workload: SampleWorkload, result, requests: list[Request]) -> None:
    """Every request finished with exactly its output length, its tokens its own
    (request i's k-th is output_token_base[i] + k), as without speculation."""
    assert result.num_finished == len(workload) and result.num_rejected == 0
    for r in requests:
        n = workload.specs[r.seq_id].output_len
        base = workload.output_token_base[r.seq_id]
        assert r.output_token_ids == list(range(base, base + n)), r.seq_id


# --- the pieces ---------------------------------------------------------------------------


class _Req:
    def __init__(self, seq_id: int, num_prompt: int, num_output: int):
        self.seq_id = seq_id
        self.all_token_ids = [0] * (num_prompt + num_output)
        self.num_output_tokens = num_output


def test_drafter_drafts_k_capped_at_max_model_len_and_right_ones_first():
    base = [1000, 2000]
    always = AcceptanceDrafter(3, 1.0, 100, base, random.Random(0))
    assert always.propose(_Req(1, 10, 5)) == [2005, 2006, 2007]
    assert always.propose(_Req(1, 90, 8)) == [2008, 2009]  # 98 tokens: room for 2 below max_model_len
    assert always.propose(_Req(1, 90, 10)) == []
    never = AcceptanceDrafter(3, 0.0, 100, base, random.Random(0))
    assert never.propose(_Req(0, 10, 5)) == [REJECTED_DRAFT] * 3
    some = AcceptanceDrafter(4, 0.5, 10**6, base, random.Random(1))
    for _ in range(200):
        drafts = some.propose(_Req(0, 10, 7))
        m = num_accepted(drafts, 1007)
        assert drafts == [*range(1007, 1007 + m), *[REJECTED_DRAFT] * (4 - m)]


def test_num_accepted_stops_at_the_first_mismatch():
    assert num_accepted([10, 11, 12], 10) == 3
    assert num_accepted([10, 99, 12], 10) == 1
    assert num_accepted([99, 11, 12], 10) == 0
    assert num_accepted([], 10) == 0


@pytest.mark.parametrize("k, rate", [(0, 0.7), (2, -0.1), (2, 1.5)])
def test_drafter_refuses_bad_settings(k: int, rate: float):
    with pytest.raises(ValueError):
        AcceptanceDrafter(k, rate, 100, [0], random.Random(0))


# --- (1) A = 0: every draft rejected ---------------------------------------------------------


def test_rate_zero_rejects_every_draft_and_costs_the_drafts_tokens(monkeypatch):
    k, prompt_len, output_len = 3, 100, 40
    workload = _workload([prompt_len], [output_len])
    plain, plain_reqs = _run(workload, monkeypatch, num_blocks=200)
    spec, spec_reqs = _run(workload, monkeypatch, num_blocks=200, num_speculative_tokens=k, spec_acceptance_rate=0.0)
    _assert_complete(workload, spec, spec_reqs)
    assert _outputs(spec_reqs) == _outputs(plain_reqs)
    # One draft of K tokens per decode step (every token after the first), none accepted.
    assert spec.spec_num_drafts == output_len - 1
    assert spec.spec_num_draft_tokens == k * (output_len - 1)
    assert spec.spec_num_accepted_tokens == 0
    assert spec.spec_draft_acceptance_rate == 0.0 and spec.spec_mean_acceptance_length == 1.0
    assert spec.spec_acceptance_rate_per_position == [0.0] * k
    # Same steps (one token each), each decode step K tokens dearer; never fast-forwarded.
    assert spec.num_steps == plain.num_steps == output_len
    assert spec.num_fast_forwarded_steps == 0 < plain.num_fast_forwarded_steps
    assert round(spec.simulated_s * 1e9) - round(plain.simulated_s * 1e9) == (output_len - 1) * k * PER_TOKEN_NS
    assert spec.finish_ns[0] > plain.finish_ns[0] and spec.first_token_ns == plain.first_token_ns


def test_rate_zero_over_many_requests_ends_each_at_its_output_length(monkeypatch):
    outputs = [1, 2, 5, 17, 33, 64, 3, 40] * 5
    workload = _workload([30 + 7 * i for i in range(len(outputs))], outputs, gap_s=0.01)
    plain, plain_reqs = _run(workload, monkeypatch, num_blocks=2000)
    spec, spec_reqs = _run(workload, monkeypatch, num_blocks=2000, num_speculative_tokens=4, spec_acceptance_rate=0.0)
    _assert_complete(workload, spec, spec_reqs)
    assert _outputs(spec_reqs) == _outputs(plain_reqs)
    assert spec.spec_num_accepted_tokens == 0 and spec.spec_num_drafts == sum(n - 1 for n in outputs)
    assert spec.simulated_s > plain.simulated_s


# --- (2) A = 1: every draft accepted -------------------------------------------------------


@pytest.mark.parametrize("k, output_len", [(4, 23), (4, 21), (3, 2), (1, 10), (7, 1)])
def test_rate_one_accepts_every_draft_in_the_steps_counted_by_hand(monkeypatch, k: int, output_len: int):
    prompt_len = 100
    workload = _workload([prompt_len], [output_len])
    plain, _ = _run(workload, monkeypatch, num_blocks=200)
    spec, reqs = _run(workload, monkeypatch, num_blocks=200, num_speculative_tokens=k, spec_acceptance_rate=1.0)
    _assert_complete(workload, spec, reqs)
    # The prefill samples the first token; each decode step then yields K + 1 (its K drafts
    # and the token after them), the last one cut at the output length.
    decode_steps = math.ceil((output_len - 1) / (k + 1))
    assert spec.num_steps == 1 + decode_steps
    assert plain.num_steps == output_len
    if output_len > k + 2:
        assert spec.num_steps < plain.num_steps
    assert spec.spec_num_drafts == decode_steps
    assert spec.spec_num_draft_tokens == spec.spec_num_accepted_tokens == k * decode_steps
    assert spec.spec_draft_acceptance_rate == (1.0 if decode_steps else 0.0)
    assert spec.spec_mean_acceptance_length == (k + 1.0 if decode_steps else 1.0)
    # Virtual time: the prefill step, then decode steps of 1 + K tokens each.
    expected_ns = (1 + decode_steps) * OVERHEAD_NS + PER_TOKEN_NS * (prompt_len + decode_steps * (1 + k))
    assert round(spec.simulated_s * 1e9) == expected_ns == spec.finish_ns[0]
    assert spec.first_token_ns[0] == OVERHEAD_NS + PER_TOKEN_NS * prompt_len


def test_rate_one_over_many_requests_takes_fewer_steps_and_less_time(monkeypatch):
    outputs = [1, 2, 9, 31, 64, 100] * 6
    workload = _workload([40 + 3 * i for i in range(len(outputs))], outputs, gap_s=0.02)
    plain, _ = _run(workload, monkeypatch, num_blocks=3000)
    spec, reqs = _run(workload, monkeypatch, num_blocks=3000, num_speculative_tokens=3, spec_acceptance_rate=1.0)
    _assert_complete(workload, spec, reqs)
    assert spec.num_steps < plain.num_steps and spec.simulated_s < plain.simulated_s
    assert spec.spec_num_accepted_tokens == spec.spec_num_draft_tokens == 3 * spec.spec_num_drafts


# --- (3) an intermediate rate, measured ----------------------------------------------------


def test_measured_acceptance_matches_the_rate(monkeypatch):
    k, rate = 3, 0.6
    n = 160
    workload = _workload([48] * n, [64] * n, gap_s=0.005, seed=3)
    result, reqs = _run(workload, monkeypatch, num_blocks=20000, num_speculative_tokens=k, spec_acceptance_rate=rate, spec_seed=11)
    _assert_complete(workload, result, reqs)
    drafts, accepted = result.spec_num_drafts, result.spec_num_accepted_tokens
    assert result.spec_num_draft_tokens == k * drafts  # no draft cut by the budget or max_model_len here
    # Per-token acceptance: each draft token is a trial up to the first rejection, so
    # A ~ accepted / (accepted + drafts that had a rejection).
    all_accepted = round(result.spec_acceptance_rate_per_position[-1] * drafts)
    measured = accepted / (accepted + drafts - all_accepted)
    assert abs(measured - rate) < 0.03, measured
    # Position i's acceptance given position i - 1's is A too.
    per_pos = [1.0, *result.spec_acceptance_rate_per_position]
    for i in range(1, k + 1):
        assert abs(per_pos[i] / per_pos[i - 1] - rate) < 0.05, (i, per_pos)
    # vLLM's draft acceptance rate and mean acceptance length for a truncated geometric.
    expected_accepted = sum(rate**i for i in range(1, k + 1))
    assert abs(result.spec_draft_acceptance_rate - expected_accepted / k) < 0.03
    assert abs(result.spec_mean_acceptance_length - (1 + expected_accepted)) < 0.08
    # Seeded: the same seed, the same run; another seed, other draws.
    again, _ = _run(workload, monkeypatch, num_blocks=20000, num_speculative_tokens=k, spec_acceptance_rate=rate, spec_seed=11)
    assert (again.spec_num_accepted_tokens, again.num_steps, again.finish_ns) == (accepted, result.num_steps, result.finish_ns)
    other, _ = _run(workload, monkeypatch, num_blocks=20000, num_speculative_tokens=k, spec_acceptance_rate=rate, spec_seed=12)
    assert other.spec_num_accepted_tokens != accepted


def test_preemption_and_a_small_pool_keep_outputs_right(monkeypatch):
    outputs = [50, 80, 20, 120] * 6
    workload = _workload([64] * len(outputs), outputs, gap_s=0.001, seed=5)
    for policy in ("fcfs", "priority"):
        result, reqs = _run(workload, monkeypatch, num_blocks=60, scheduling_policy=policy,
                            num_speculative_tokens=4, spec_acceptance_rate=0.5)
        assert result.num_preemptions > 0
        _assert_complete(workload, result, reqs)


def test_a_fleet_counts_its_replicas_drafts():
    workload = _workload([40] * 20, [30] * 20, gap_s=0.01)
    cfg = SimConfig(num_blocks=500, num_speculative_tokens=2, spec_acceptance_rate=1.0)
    result = simulate_fleet(workload, cfg, 2, "round_robin")
    assert result.num_finished == 20
    spec = result.spec_decode
    assert spec["num_speculative_tokens"] == 2 and spec["spec_num_accepted_tokens"] == spec["spec_num_draft_tokens"] > 0
    assert simulate_fleet(workload, SimConfig(num_blocks=500), 2, "round_robin").spec_decode == {}


# --- (4) the CLI ---------------------------------------------------------------------------

_RUN = ["--dataset", "random", "--num-requests", "12", "--input-len", "40", "--output-len", "20", "--num-blocks", "400"]


def test_cli_table_and_json_show_the_spec_figures(tmp_path: Path, capsys):
    out = tmp_path / "spec.json"
    assert main([*_RUN, "--num-speculative-tokens", "3", "--spec-acceptance-rate", "0.5", "--seed", "4", "--result-json", str(out)]) == 0
    table = capsys.readouterr().out
    for header in ("spec K", "drafts", "draft tokens", "accepted", "draft accept", "mean accept len"):
        assert header in table
    doc = json.loads(out.read_text())
    assert doc["config"]["num_speculative_tokens"] == 3 and doc["config"]["spec_acceptance_rate"] == 0.5
    r = doc["results"][0]
    assert r["num_finished"] == 12 and r["num_speculative_tokens"] == 3
    assert r["spec_num_draft_tokens"] == 3 * r["spec_num_drafts"] and 0 < r["spec_num_accepted_tokens"] < r["spec_num_draft_tokens"]
    assert r["spec_mean_acceptance_length"] == pytest.approx(1 + r["spec_num_accepted_tokens"] / r["spec_num_drafts"])
    assert r["spec_draft_acceptance_rate"] == pytest.approx(r["spec_num_accepted_tokens"] / r["spec_num_draft_tokens"])
    # Without speculation: neither columns nor figures.
    assert main([*_RUN, "--result-json", str(out)]) == 0
    assert "draft accept" not in capsys.readouterr().out
    assert not any(key.startswith("spec_") for key in json.loads(out.read_text())["results"][0])


def test_cli_default_acceptance_rate(tmp_path: Path, capsys):
    out = tmp_path / "spec.json"
    assert main([*_RUN, "--num-speculative-tokens", "2", "--result-json", str(out)]) == 0
    assert json.loads(out.read_text())["config"]["spec_acceptance_rate"] == 0.7


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--spec-acceptance-rate", "0.5"], "--spec-acceptance-rate needs --num-speculative-tokens K > 0"),
        (["--num-speculative-tokens", "0", "--spec-acceptance-rate", "0.5"], "--spec-acceptance-rate needs --num-speculative-tokens"),
        (["--num-speculative-tokens", "2", "--spec-acceptance-rate", "1.5"], "--spec-acceptance-rate must be a probability in [0, 1], got 1.5"),
        (["--num-speculative-tokens", "2", "--spec-acceptance-rate", "-0.1"], "--spec-acceptance-rate must be a probability in [0, 1]"),
        (["--num-speculative-tokens", "2", "--spec-acceptance-rate", "nan"], "--spec-acceptance-rate must be a probability in [0, 1]"),
        (["--num-speculative-tokens", "-1"], "--num-speculative-tokens must be >= 0"),
        (["--num-speculative-tokens", "two"], "--num-speculative-tokens: invalid int value"),
        (["--num-speculative-tokens", "2", "--spec-acceptance-rate", "high"], "--spec-acceptance-rate: invalid float value"),
    ],
)
def test_cli_refuses_bad_spec_flags(argv: list[str], message: str, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--num-blocks", "100", *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_help_documents_the_flags(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "--num-speculative-tokens K" in out and "--spec-acceptance-rate A" in out
