"""The simulator runs the scheduler's policy options (simulator/engine.py, cli.py):
--scheduling-policy priority with --priority-levels, the long-prefill cap, chunked
prefill off, --watermark and --max-num-scheduled-tokens; fast-forwarding still changes nothing, and the options are checked as
the scheduler process checks them."""

from __future__ import annotations

import dataclasses

import pytest

from loadgen.datasets import shared_prefix_requests
from scheduler.sched.scheduler import Scheduler
from simulator.cli import main, parse_args
from simulator.config import SimConfig
from simulator.replay import simulate
from simulator.run_setup import build_workload
from simulator.workload import SampleWorkload


def _equivalence_case(workload, cfg: SimConfig) -> None:
    """Fast-forwarding changes nothing: every figure, every request's times and the
    final free queue equal stepping one by one (as tests/simulator/test_simulate.py)."""
    states: list[list] = []

    def final_queue(sched: Scheduler) -> None:
        sched.kv_cache_manager.check_invariants()
        states.append([(b.block_id, b.block_hash) for b in sched.kv_cache_manager.block_pool.free_block_queue])

    fast = simulate(workload, cfg, on_end=final_queue)
    slow = simulate(workload, dataclasses.replace(cfg, fast_forward=False), on_end=final_queue)
    assert fast.num_fast_forwarded_steps > 0 and slow.num_fast_forwarded_steps == 0
    for name in ("prefix_cache_hits", "num_evictions", "num_preemptions", "num_finished", "peak_usage", "num_steps",
                 "simulated_s", "admit_ns", "first_token_ns", "finish_ns"):
        assert getattr(fast, name) == getattr(slow, name), name
    assert states[0] == states[1]


def workload(n: int = 60, output_len: int = 30, arrivals: list[float] | None = None, levels: int = 1) -> SampleWorkload:
    samples = shared_prefix_requests(n, 4, 40, 12, output_len, vocab_size=100, seed=3)
    w = SampleWorkload(samples, arrivals if arrivals is not None else [0.0] * n, 100)
    if levels > 1:
        w.specs = [dataclasses.replace(s, priority=i % levels) for i, s in enumerate(w.specs)]
    return w


def test_priority_admits_every_urgent_request_before_any_other():
    # All arrive at t=0; two at a time run. Priorities 0, 1, 0, 1, ...: under priority
    # every 0 is admitted no later than any 1; under fcfs they alternate, by arrival.
    w = workload(levels=2)
    cfg = SimConfig(400, 4, max_num_seqs=2, max_num_batched_tokens=256, scheduling_policy="priority")
    r = simulate(w, cfg)
    urgent = [r.admit_ns[i] for i, s in enumerate(w.specs) if s.priority == 0]
    other = [r.admit_ns[i] for i, s in enumerate(w.specs) if s.priority == 1]
    assert r.num_finished == 60 and max(urgent) <= min(other)
    fcfs = simulate(w, dataclasses.replace(cfg, scheduling_policy="fcfs"))
    assert fcfs.admit_ns[1] < fcfs.admit_ns[2] and min(b - a for a, b in zip(fcfs.admit_ns, fcfs.admit_ns[1:], strict=False)) >= 0


def test_fast_forward_changes_nothing_under_priority_preemption_and_the_cap():
    n = 80
    w = workload(n, 70, [i * 0.013 for i in range(n)], levels=3)
    cfg = SimConfig(120, 4, "vllm", max_num_seqs=12, max_num_batched_tokens=64, step_overhead_ms=1.0, ms_per_token=0.01,
                    scheduling_policy="priority", long_prefill_token_threshold=16)
    _equivalence_case(w, cfg)
    assert simulate(w, cfg).num_preemptions > 0


def test_fast_forward_changes_nothing_without_chunked_prefill():
    n = 60
    w = workload(n, 40, [i * 0.01 for i in range(n)])
    cfg = SimConfig(150, 4, "vllm", max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256, step_overhead_ms=1.0,
                    enable_chunked_prefill=False)
    _equivalence_case(w, cfg)


def test_the_cli_draws_priority_levels_from_the_seed():
    a = parse_args(["--num-blocks", "100", "--dataset", "random", "--num-requests", "200", "--priority-levels", "3", "--seed", "4"])
    levels = [s.priority for s in build_workload(a).specs]
    assert set(levels) == {0, 1, 2} and levels == [s.priority for s in build_workload(a).specs]
    assert {s.priority for s in build_workload(parse_args(["--num-blocks", "100", "--dataset", "random"])).specs} == {0}


def test_the_cli_runs_the_priority_policy(capsys):
    assert main(["--dataset", "random", "--num-requests", "30", "--input-len", "40", "--output-len", "5", "--num-blocks", "64",
                 "--block-size", "4", "--scheduling-policy", "priority", "--priority-levels", "2",
                 "--long-prefill-token-threshold", "16"]) == 0
    assert "preemptions" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--no-enable-chunked-prefill"], "--max-num-batched-tokens (8192) is smaller than --max-model-len (131072)"),
        (["--long-prefill-token-threshold", "-2"], "--long-prefill-token-threshold must be >= 0"),
        (["--scheduling-policy", "sjf"], "invalid choice: 'sjf'"),
        (["--priority-levels", "0"], "--priority-levels must be positive"),
        (["--watermark", "1"], "--watermark must be in the range [0.0, 1.0)"),
        (["--max-num-scheduled-tokens", "0"], "--max-num-scheduled-tokens must be >= 1"),
    ],
)
def test_bad_policy_flags_exit_2_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--num-blocks", "100", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_the_watermark_and_the_step_cap_reach_the_simulated_scheduler():
    a = parse_args(["--num-blocks", "100", "--watermark", "0.25", "--max-num-scheduled-tokens", "2k"])
    seen: list[Scheduler] = []
    cfg = SimConfig(100, 4, max_num_batched_tokens=4096, watermark=a.watermark, max_num_scheduled_tokens=a.max_num_scheduled_tokens)
    simulate(workload(4, 3), cfg, on_end=seen.append)
    # int(0.25 * 100) = 25 blocks kept free; the step: min(2000, 4096)
    assert (seen[0].watermark_blocks, seen[0].step_token_budget) == (25, 2000)


def test_fast_forward_changes_nothing_under_the_watermark_and_a_step_cap():
    n = 80
    w = workload(n, 70, [i * 0.013 for i in range(n)])
    cfg = SimConfig(120, 4, "vllm", max_num_seqs=12, max_num_batched_tokens=64, step_overhead_ms=1.0, ms_per_token=0.01,
                    watermark=0.4, max_num_scheduled_tokens=24)
    _equivalence_case(w, cfg)
    # the watermark (48 of 120 blocks) holds admissions back: the same work in more steps
    plain = simulate(w, dataclasses.replace(cfg, watermark=0.0))
    held = simulate(w, cfg)
    assert held.num_finished == plain.num_finished == n and held.num_steps > plain.num_steps


def test_max_num_active_seqs_caps_the_simulated_running_batch(monkeypatch):
    a = parse_args(["--num-blocks", "500", "--max-num-seqs", "12", "--max-num-active-seqs", "3"])
    assert a.max_num_active_seqs == 3
    peaks: list[int] = []
    n = 40
    w = workload(n, 20)
    cfg = SimConfig(500, 4, "vllm", max_num_seqs=12, max_num_batched_tokens=512, max_num_active_seqs=a.max_num_active_seqs)
    _equivalence_case(w, cfg)

    class Watch(Scheduler):
        def schedule(self):
            out = super().schedule()
            peaks.append(self.num_running)
            return out

    monkeypatch.setattr("simulator.engine.scheduler_class", lambda policy: Watch)
    capped = simulate(w, cfg)
    monkeypatch.undo()
    # 40 requests all at once, room for 12 rows: never more than 3 run
    assert capped.num_finished == n and max(peaks) == 3
    plain = simulate(w, SimConfig(500, 4, "vllm", max_num_seqs=12, max_num_batched_tokens=512))
    assert plain.num_steps < capped.num_steps


def test_max_num_active_seqs_above_max_num_seqs_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--num-blocks", "100", "--max-num-seqs", "4", "--max-num-active-seqs", "5"])
    assert e.value.code == 2 and "max_num_active_seqs (5) cannot be greater than max_num_seqs (4)." in capsys.readouterr().err
