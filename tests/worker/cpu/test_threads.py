"""The worker leaves a core to the scheduler unless OMP_NUM_THREADS is given, takes it
back for a big step (``--cpu-wide-step-tokens``, by default from the model's size), and
runs at a lower priority on CPU (``--cpu-nice``), its torch threads too."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from worker.cpu.threads import (
    WIDE_STEP_MEMORY_WEIGHTS,
    WIDE_STEP_WEIGHT_TOKENS,
    StepThreads,
    default_num_threads,
    projection_weights,
    wide_num_threads,
    wide_step_tokens,
)

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(("env", "cpus", "expected"), [
    ({}, 2, 1), ({}, 16, 15), ({}, 1, 1), ({}, None, 1),
    ({"OMP_NUM_THREADS": "2"}, 2, None), ({"OMP_NUM_THREADS": ""}, 4, 3),
])
def test_one_core_fewer_than_the_machine_unless_told(env, cpus, expected):
    assert default_num_threads(env, cpus) == expected


def test_the_worker_and_the_threads_torch_starts_after_run_at_the_nice_asked():
    # As worker.startup does it: torch imported first, the priority lowered, then the
    # threads set and a parallel op run. Every thread of the process must be at nice 5.
    code = textwrap.dedent("""
        import os
        import torch
        from worker.cpu.threads import lower_cpu_priority
        before = os.getpriority(os.PRIO_PROCESS, 0)
        print(lower_cpu_priority(before + 5), lower_cpu_priority(before + 2))
        torch.set_num_threads(2)
        torch.ones(4096, 4096).sum()
        # Field 19 of /proc/self/task/TID/stat is the thread's nice value.
        tasks = "/proc/self/task"
        nices = [open(f"{tasks}/{tid}/stat").read().rsplit(")", 1)[1].split()[16] for tid in os.listdir(tasks)]
        print(before, *nices)
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    first, second = r.stdout.split("\n")[:2]
    before, *threads = map(int, second.split())
    assert first.split() == [str(before + 5)] * 2  # never raised back by a smaller value
    assert len(threads) >= 2 and set(threads) == {before + 5}


@pytest.mark.parametrize("nice", ["-1", "20"])
def test_a_nice_outside_0_to_19_is_refused(nice):
    r = subprocess.run([sys.executable, "-m", "worker", "--cpu-nice", nice], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--cpu-nice must be 0..19" in r.stderr


@pytest.mark.parametrize(("env", "cpus", "tp", "expected"), [
    ({}, 2, 1, 2), ({}, 16, 1, 16), ({}, None, 1, 1),
    ({"OMP_NUM_THREADS": "1"}, 2, 1, None), ({}, 4, 2, None),
])
def test_a_big_step_takes_every_core_unless_told_the_count_or_ranks_share_them(env, cpus, tp, expected):
    assert wide_num_threads(env, cpus, tp) == expected


def test_a_step_of_at_least_min_tokens_runs_wide_and_the_count_comes_back(one_thread):
    threads = StepThreads(wide=3, min_tokens=128)
    seen = {}
    for n in (1, 127, 128, 2048):
        with threads.step(n):
            seen[n] = torch.get_num_threads()
        assert torch.get_num_threads() == 1
    assert seen == {1: 1, 127: 1, 128: 3, 2048: 3}
    with pytest.raises(RuntimeError, match="boom"), threads.step(500):
        raise RuntimeError("boom")  # a failing forward restores the count too
    assert torch.get_num_threads() == 1
    for off in (StepThreads(None, 128), StepThreads(3, 0)):
        with off.step(4096):
            assert torch.get_num_threads() == 1


def test_a_token_meets_each_layers_q_k_v_o_and_gated_mlp_weights():
    # The tiny checkpoint's shape: hidden 256, MLP 768, 4 layers, 8 query heads and 2 KV
    # heads of 32. A layer: q 256x256, k and v 256x64 each, o 256x256, gate, up and down
    # 256x768 each.
    per_layer = 256 * 256 + 2 * 256 * 64 + 256 * 256 + 3 * 256 * 768
    assert per_layer == 753_664
    assert projection_weights(256, 768, 4, 256, 64) == 4 * per_layer


@pytest.mark.parametrize(("weights", "tokens"), [
    (4 * 753_664, 128),  # the tiny checkpoint: its prefill waves, not its decode steps
    (8 * (768 * (2 * 768 + 2 * 256) + 3 * 768 * 2048), 1),  # llama50m (50M): every step reads its weights from memory
    (30 * (576 * (2 * 576 + 2 * 192) + 3 * 576 * 1536), 1),  # SmolLM2-135M (106M)
    (WIDE_STEP_MEMORY_WEIGHTS - 1, 13), (WIDE_STEP_MEMORY_WEIGHTS, 1),
    (WIDE_STEP_WEIGHT_TOKENS // 16, 16), (WIDE_STEP_WEIGHT_TOKENS // 16 - 1, 17), (0, WIDE_STEP_WEIGHT_TOKENS),
])
def test_the_default_wide_step_shrinks_as_the_model_grows(weights, tokens):
    assert wide_step_tokens(weights) == tokens


def test_the_worker_takes_its_wide_step_from_the_model_unless_told(tiny_checkpoint):
    from worker.config import WorkerConfig
    from worker.load.serving_model import load_serving_model
    from worker.process import WorkerProcess
    from worker.startup import allocate_worker_kv_caches

    serving = load_serving_model(tiny_checkpoint, "float32", "cpu", 64)
    for told, expected in ((None, 128), (5, 5), (0, 0)):
        config = WorkerConfig(block_size=4, kv_cache_memory=64 * 1024, cpu_wide_step_tokens=told)
        proc = WorkerProcess(config, serving, allocate_worker_kv_caches(config, serving, None)[0], None)
        assert proc._step_threads().min_tokens == expected


def test_a_negative_wide_step_is_refused():
    r = subprocess.run([sys.executable, "-m", "worker", "--cpu-wide-step-tokens", "-1"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "--cpu-wide-step-tokens must be >= 0" in r.stderr
