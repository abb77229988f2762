"""Batched sampling against plain per-request reference implementations.

The draw picks each token with its probability, seeded rows and unseeded alike, and a
masked token never; seeded draws are reproducible whatever else is in the batch (and across preemption);
top_k=1 and temperature -> 0 equal greedy; penalties, min_tokens, top-k/top-p/min-p and
logprobs match what a loop over one request at a time computes.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from kvtest.mini_scheduler import MiniScheduler

from protocol.sampling_params import SamplingParams
from worker.kv.kv_cache import allocate_kv_caches
from worker.load.checkpoint import Checkpoint
from worker.models.loader import load_model
from worker.sample import sampler
from worker.sample.sampler import Penalties, apply_penalties
from worker.sample.sampling_state import SamplingState
from worker.step.runner import ModelRunner
from worker.tiny.generate import write_tiny_checkpoint

V = 64


def logits_for(step: int, key: int, n: int = V) -> torch.Tensor:
    """Logits that depend only on (step, key): what a request would see whatever the batch."""
    return torch.randn(n, generator=torch.Generator().manual_seed(step * 1000 + key)) * 2.0


def run_batch(state: SamplingState, members: dict[int, int], steps: int) -> dict[int, list[int]]:
    """members: table row -> key. Each step samples every member once."""
    out = {r: [] for r in members}
    for step in range(steps):
        rows = list(members)
        logits = torch.stack([logits_for(step, members[r]) for r in rows])
        tokens, _ = state.sample(logits, rows, [len(out[r]) for r in rows])
        for r, t in zip(rows, tokens, strict=True):
            out[r].append(t)
    return out


# By hand: a distribution with masked tokens (probability 0) among, before and after the others.
PROBS = [0.0, 0.1, 0.0, 0.25, 0.05, 0.6, 0.0, 0.0]


@pytest.mark.parametrize("seeded", [False, True])
def test_the_draw_picks_each_token_with_its_probability(seeded: bool):
    n = 100_000
    probs = torch.tensor(PROBS).expand(n, -1) * 3.0  # a row's total need not be 1
    rows = [(i, 12345 + i) for i in range(n)] if seeded else []
    tokens = sampler.draw(probs, rows, torch.Generator().manual_seed(7))
    freq = torch.bincount(tokens, minlength=len(PROBS)).double() / n
    # 5 standard deviations of a frequency of n draws at most
    assert (freq - torch.tensor(PROBS, dtype=torch.float64)).abs().max() < 5 * math.sqrt(0.25 / n)
    assert all(freq[i] == 0 for i, p in enumerate(PROBS) if p == 0.0)


def test_a_uniform_that_rounds_up_to_the_total_still_draws_a_token_of_the_row(monkeypatch):
    just_below_1 = math.nextafter(1.0, 0.0)
    monkeypatch.setattr(sampler, "_uniforms", lambda n, device, seeded, gen: torch.full((n,), just_below_1, dtype=torch.float64))
    probs = torch.tensor([[0.1, 0.2, 0.3, 0.0, 0.0], [0.5, 0.5, 1e-30, 0.0, 0.0]])
    # the last token that carries probability; the 1e-30 is below float64's rounding of 1
    assert sampler.draw(probs, [], None).tolist() == [2, 1]


def test_seeded_rows_draw_the_same_tokens_whatever_the_batch():
    p = SamplingParams(temperature=1.0, seed=1234)
    alone = SamplingState(8, V, torch.device("cpu"))
    alone.add(0, p, [5], 1)
    a = run_batch(alone, {0: 7}, 30)[0]
    crowd = SamplingState(8, V, torch.device("cpu"))
    crowd.add(1, SamplingParams(temperature=0.7, top_p=0.9), [5], 1)
    crowd.add(5, p, [5], 1)  # another table row, other neighbours
    crowd.add(2, SamplingParams(temperature=1.3, seed=99), [5], 1)
    crowd.add(3, None, [5], 1)
    b = run_batch(crowd, {1: 3, 5: 7, 2: 9, 3: 11}, 30)
    assert b[5] == a
    assert len(set(a)) > 5  # it really sampled
    other = SamplingState(8, V, torch.device("cpu"))
    other.add(0, SamplingParams(temperature=1.0, seed=4321), [5], 1)
    assert run_batch(other, {0: 7}, 30)[0] != a


def _unseeded_run(global_seed: int, steps: int = 30) -> dict[int, list[int]]:
    state = SamplingState(8, V, torch.device("cpu"), seed=global_seed)
    state.add(0, SamplingParams(temperature=1.0), [5], 1)  # no seed of its own
    state.add(3, SamplingParams(temperature=0.8, top_p=0.9), [5], 1)
    state.add(4, SamplingParams(temperature=1.0, seed=1234), [5], 1)
    state.add(6, SamplingParams(temperature=0.0), [5], 1)  # greedy
    return run_batch(state, {0: 7, 3: 8, 4: 7, 6: 9}, steps)


def test_the_global_seed_repeats_unseeded_rows_and_leaves_seeded_and_greedy_rows_alone():
    torch.manual_seed(999)  # the default generator's state must not matter
    a = _unseeded_run(7)
    torch.manual_seed(12345)
    torch.rand(100)
    b = _unseeded_run(7)
    c = _unseeded_run(8)
    assert a == b
    assert len(set(a[0])) > 5  # it really sampled
    assert a[0] != c[0] and a[3] != c[3]
    # a row with its own seed draws what it draws alone, whatever the global seed
    alone = SamplingState(8, V, torch.device("cpu"), seed=1)
    alone.add(0, SamplingParams(temperature=1.0, seed=1234), [5], 1)
    assert a[4] == c[4] == run_batch(alone, {0: 7}, 30)[0]
    assert a[6] == c[6] == [int(logits_for(s, 9).argmax()) for s in range(30)]


@pytest.mark.parametrize("bad", [-1, 2**64, 1.5, True, "7"])
def test_a_bad_global_seed_is_refused(bad):
    with pytest.raises(ValueError, match="global seed must be an integer in 0..2\\*\\*64-1"):
        SamplingState(2, V, torch.device("cpu"), seed=bad)


def test_top_k_1_and_temperature_to_0_equal_greedy():
    for params in (SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1e-6),
                   SamplingParams(temperature=1e-3), SamplingParams(temperature=2.0, top_k=1, seed=3)):
        state = SamplingState(4, V, torch.device("cpu"))
        state.add(2, params, [1], 1)
        got = run_batch(state, {2: 4}, 20)[2]
        assert got == [int(logits_for(s, 4).argmax()) for s in range(20)], params


def reference_penalised(logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams) -> torch.Tensor:
    """One request, token by token (vLLM's documented semantics)."""
    out = logits.clone().double()
    for v in range(out.shape[0]):
        if v in prompt or v in output:
            out[v] = out[v] / p.repetition_penalty if out[v] > 0 else out[v] * p.repetition_penalty
        count = output.count(v)
        out[v] -= p.frequency_penalty * count
        if count:
            out[v] -= p.presence_penalty
    return out


def test_penalties_match_a_per_request_reference():
    rng = random.Random(0)
    params = [SamplingParams(repetition_penalty=1.3), SamplingParams(presence_penalty=0.8, frequency_penalty=0.5),
              SamplingParams(repetition_penalty=0.7, presence_penalty=-0.5, frequency_penalty=1.5), None]
    state = SamplingState(8, V, torch.device("cpu"))
    history = {}
    for row, p in zip((6, 1, 3, 0), params, strict=True):
        prompt = [rng.randrange(V) for _ in range(12)]
        out = [rng.randrange(V) for _ in range(rng.randrange(4))]  # a resumed row has outputs already
        state.add(row, p, prompt + out, len(prompt))
        history[row] = (p, prompt, out)
    for step in range(25):
        rows = list(history)
        logits = torch.stack([logits_for(step, r) for r in rows])
        tokens, _ = state.sample(logits, rows, [len(history[r][2]) for r in rows])
        for i, r in enumerate(rows):
            p, prompt, out = history[r]
            expected = reference_penalised(logits[i], prompt, out, p or SamplingParams()).argmax()
            assert tokens[i] == int(expected), (step, r)
            out.append(tokens[i])


def test_apply_penalties_values():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, V, generator=gen) * 3
    prompts = [[1, 2, 3], [], [4, 4, 9]]
    outputs = [[2, 2, 7], [5, 5, 5, 6], []]
    ps = [SamplingParams(repetition_penalty=1.5, frequency_penalty=0.3, presence_penalty=0.2),
          SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.4, presence_penalty=1.0),
          SamplingParams(repetition_penalty=2.0)]
    counts = torch.zeros(3, V, dtype=torch.int32)
    mask = torch.zeros(3, V, dtype=torch.bool)
    for i in range(3):
        for t in outputs[i]:
            counts[i, t] += 1
        mask[i, prompts[i]] = True
    got = apply_penalties(logits, Penalties(
        torch.tensor([p.presence_penalty for p in ps]), torch.tensor([p.frequency_penalty for p in ps]),
        torch.tensor([p.repetition_penalty for p in ps]), counts, mask))
    for i in range(3):
        torch.testing.assert_close(got[i].double(), reference_penalised(logits[i], prompts[i], outputs[i], ps[i]), rtol=1e-6, atol=1e-6)


def test_min_tokens_masks_stop_ids_until_reached():
    # Make token 3 (a stop id) the argmax every step: it can come only from the 4th token on.
    state = SamplingState(2, V, torch.device("cpu"))
    state.add(0, SamplingParams(min_tokens=3, stop_token_ids=[3, 9]), [1], 1)
    out = []
    for step in range(5):
        logits = logits_for(step, 0)
        logits[3], logits[9] = 100.0, 90.0
        tokens, _ = state.sample(logits[None], [0], [len(out)])
        out.append(tokens[0])
    assert all(t not in (3, 9) for t in out[:3]) and out[3:] == [3, 3]


def allowed_set(logits: torch.Tensor, p: SamplingParams) -> set[int]:
    """Per request: the tokens temperature, min-p, top-k, then top-p leave (vLLM's order)."""
    scaled = (logits.double() / p.temperature)
    probs = scaled.softmax(-1)
    keep = [v for v in range(len(probs)) if probs[v] >= p.min_p * probs.max()]
    keep.sort(key=lambda v: -float(scaled[v]))
    if p.top_k > 0:
        keep = keep[: p.top_k]
    sub = torch.tensor([float(scaled[v]) for v in keep]).double().softmax(-1)
    kept, total = [], 0.0
    for v, q in zip(keep, sub.tolist(), strict=True):
        kept.append(v)
        total += q
        if total >= p.top_p:
            break
    return set(kept)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=0.8, top_p=0.5),
    SamplingParams(temperature=1.5, min_p=0.2), SamplingParams(temperature=1.0, top_k=10, top_p=0.7, min_p=0.05),
])
def test_sampled_tokens_stay_inside_top_k_top_p_min_p(params):
    state = SamplingState(4, V, torch.device("cpu"))
    rows = [0, 1, 2, 3]
    for r in rows:
        state.add(r, params, [1], 1)
    seen = set()
    for step in range(60):
        logits = torch.stack([logits_for(step, r) for r in rows])
        tokens, _ = state.sample(logits, rows, [step] * 4)
        for i, t in enumerate(tokens):
            assert t in allowed_set(logits[i], params), (step, i, t)
            seen.add(t)
    assert len(seen) > 3


def test_logprobs_of_the_raw_logits_and_top_k():
    state = SamplingState(3, V, torch.device("cpu"))
    state.add(0, SamplingParams(logprobs=5, repetition_penalty=1.5), [1, 2], 2)
    state.add(1, None, [1], 1)
    state.add(2, SamplingParams(logprobs=0, temperature=1.0, seed=1), [1], 1)
    logits = torch.stack([logits_for(0, r) for r in range(3)])
    tokens, lps = state.sample(logits, [0, 1, 2], [0, 0, 0])
    assert lps[1] is None
    for i in (0, 2):
        ref = logits[i].double().log_softmax(-1)
        assert math.isclose(lps[i].logprob, float(ref[tokens[i]]), rel_tol=1e-5, abs_tol=1e-6)
    top = ref_top = logits[0].double().log_softmax(-1).topk(5)
    assert lps[0].top_token_ids == top.indices.tolist()
    assert lps[0].top_logprobs == pytest.approx(ref_top.values.tolist(), rel=1e-5)
    assert lps[2].top_token_ids == [] and lps[2].top_logprobs == []


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(Checkpoint(write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))), torch.float32, "cpu")


def run_requests(model, specs, seed: int) -> dict[int, list[int]]:
    c = model.config
    caches = allocate_kv_caches(c.num_layers, 128, 16, c.num_kv_heads, c.head_dim, torch.float32, "cpu")
    sched = MiniScheduler(ModelRunner(model, caches, 8, 256), random.Random(seed), 128, 16)
    for sid, (prompt, params) in specs.items():
        sched.add(sid, prompt, 24, sampling=params)
    sched.run()
    return {sid: sched.done[sid].out for sid in specs}, sched


def test_seeded_requests_through_the_runner_ignore_batch_and_preemption(tiny):
    prompt = list(range(10, 30))
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=42, presence_penalty=0.5)
    alone, _ = run_requests(tiny, {0: (prompt, seeded)}, seed=0)
    others = {i: ([7 * i % 500 + 2 for _ in range(5 + i)], SamplingParams(temperature=0.9) if i % 2 else None) for i in range(1, 6)}
    crowded, sched = run_requests(tiny, {0: (prompt, seeded), **others}, seed=3)
    assert crowded[0] == alone[0]
    assert sched.num_preempted > 0  # and preemption/resume happened along the way


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_seeded_rows_are_reproducible_and_greedy_rows_are_argmax():
    dev = torch.device("cuda")
    runs = []
    for extra in (False, True):
        state = SamplingState(4, V, dev)
        state.add(0, SamplingParams(temperature=1.0, top_k=20, seed=5, frequency_penalty=0.3), [1, 2], 2)
        state.add(1, None, [1], 1)
        if extra:
            state.add(2, SamplingParams(temperature=0.5), [1], 1)
        rows = [0, 1, 2] if extra else [0, 1]
        out = {r: [] for r in rows}
        for step in range(20):
            logits = torch.stack([logits_for(step, r) for r in rows]).to(dev)
            tokens, _ = state.sample(logits, rows, [len(out[r]) for r in rows])
            for r, t in zip(rows, tokens, strict=True):
                out[r].append(t)
        assert out[1] == [int(logits_for(s, 1).argmax()) for s in range(20)]
        runs.append(out[0])
    assert runs[0] == runs[1]
