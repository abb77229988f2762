"""Speculative decoding end to end in one process: the real Scheduler (n-gram or suffix drafts, the
manager's slots for them, rollback) and the real ModelRunner (one forward over each row's
last token and drafts, verification by sampling at each position) on the tiny checkpoint.

The drafts of some tests come from an oracle that knows the answer (a run without drafts)
and spoils one draft on purpose, so how many are accepted is known in advance; the tiny
checkpoint's random weights seldom repeat their prompt, which n-gram drafts need.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from protocol.sampling_params import SamplingParams
from protocol.speculative_config import SpeculativeConfig
from protocol.worker_messages import StepResult
from scheduler.core.hashing import BlockHasher
from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.sched.request import Request
from scheduler.sched.scheduler import Scheduler
from scheduler.spec.suffix_proposer import SuffixProposer
from worker.kv.kv_cache import allocate_kv_caches
from worker.load.checkpoint import Checkpoint
from worker.models.loader import load_model
from worker.step.runner import ModelRunner

BS, MAX_LEN = 4, 256


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return load_model(Checkpoint(tiny_checkpoint), torch.float32, "cpu")


class Oracle:
    """Drafts the next ``k`` tokens of the answer (request id -> its whole output), the one at
    ``spoil(request, step)`` replaced by a wrong token (>= k: none). Records, per draft, how
    many should be accepted: the drafts before the spoiled one."""

    def __init__(self, answers: dict[str, list[int]], k: int, spoil):
        self.answers, self.k, self.spoil = answers, k, spoil
        self.expected_accepted: list[int] = []
        self.calls = 0

    def propose(self, request) -> list[int]:
        answer = self.answers[request.request_id]
        done = request.num_tokens - request.num_prompt_tokens
        drafts = answer[done : done + self.k]
        if not drafts:
            return []
        self.calls += 1
        bad = self.spoil(request, self.calls)
        if bad < len(drafts):
            drafts[bad] = (drafts[bad] + 1) % 500 + 2  # any other token
        self.expected_accepted.append(min(bad, len(drafts)))
        return drafts

    def stop(self, request) -> None:
        pass

    def finish(self, request) -> None:
        pass


def run(model, prompts, max_tokens, *, spec=None, oracle=None, num_blocks=256, max_num_seqs=8, budget=64, sampling=None, check=None):
    """Every prompt through the scheduler and the runner to the end: the outputs by request id
    (as the clients get them), the scheduler and the manager. ``check(sched, kv, runner)`` after each step."""
    c = model.config
    caches = allocate_kv_caches(c.num_layers, num_blocks, BS, c.num_kv_heads, c.head_dim, torch.float32, "cpu")
    runner = ModelRunner(model, caches, max_num_seqs, MAX_LEN)
    kv = KVCacheManager(num_blocks, BS, MAX_LEN)
    sched = Scheduler(kv, max_num_seqs, budget, MAX_LEN, speculative=spec)
    if oracle is not None:
        sched.proposer = oracle
    hasher = BlockHasher(BS)
    outputs: dict[str, list[int]] = {}
    for j, prompt in enumerate(prompts):
        params = sampling(j) if sampling else None
        sched.add_request(Request(f"r{j}", prompt, max_tokens, seq_id=j, ignore_eos=True, block_hasher=hasher, sampling=params))
        outputs[f"r{j}"] = []
    for _ in range(5000):
        if not sched.has_unfinished_requests():
            return outputs, sched, kv
        out = sched.schedule()
        res = runner.execute(out.plan)
        step = sched.update_from_output(StepResult(out.plan.step_id, res.seq_ids, res.sampled_token_ids,
                                                   extra_token_ids=res.extra_token_ids or {}))
        for i, r in enumerate(step.requests):
            outputs[r.request_id] += step.new_token_ids(i)
        kv.check_invariants()
        for r in sched.running:  # the worker's table is the manager's (append-only, drafts' slots included)
            assert runner.block_table.block_ids(r.seq_id) == kv.get_block_ids(r.request_id)[0]
        if check is not None:
            check(sched, kv, runner)
    raise AssertionError("the requests did not finish")


def prompts_of(n: int) -> list[list[int]]:
    """Prompts of 6..37 tokens; every third repeats a phrase (n-gram drafts find it)."""
    out = []
    for j in range(n):
        base = [(13 * i + 7 * j) % 480 + 2 for i in range(6 + j % 11)]
        out.append(base * (2 + j % 2) if j % 3 == 0 else base + [(5 * i + j) % 480 + 2 for i in range(j % 7)])
    return out


def test_greedy_outputs_are_identical_with_and_without_ngram_drafts_for_64_prompts(model):
    prompts = prompts_of(64)
    plain, _, _ = run(model, prompts, 20)
    spec, sched, _ = run(model, prompts, 20, spec=SpeculativeConfig(3, 1, 3))
    assert spec == plain and all(len(o) == 20 for o in plain.values())
    stats = sched.spec_stats
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert sched.num_generation_tokens == 64 * 20


@pytest.mark.parametrize("num_blocks", [256, 40])
def test_greedy_outputs_are_identical_with_and_without_suffix_drafts(model, num_blocks):
    # Each prompt twice, apart: the later request drafts from the earlier one's response in the
    # global tree (the tiny model seldom repeats its own prompt). 40 blocks: preemptions, after
    # which a request drafts from a fresh tree of its prompt.
    prompts = prompts_of(8)
    prompts = [*prompts, *prompts]
    plain, _, _ = run(model, prompts, 24, num_blocks=num_blocks, max_num_seqs=4)
    spec = SpeculativeConfig(6, method="suffix", suffix_decoding_max_tree_depth=12)
    got, sched, _ = run(model, prompts, 24, spec=spec, num_blocks=num_blocks, max_num_seqs=4)
    assert got == plain
    stats = sched.spec_stats
    assert 0 < stats.num_accepted_tokens <= stats.num_draft_tokens
    assert num_blocks == 256 or sched.num_preemptions > 0


class SuffixSpy(SuffixProposer):
    """Suffix drafts, counting what the scheduler tells the drafter."""

    def __init__(self, *args):
        super().__init__(*args)
        self.stopped: Counter[str] = Counter()
        self.finished: list[str] = []

    def stop(self, request) -> None:
        self.stopped[request.request_id] += 1
        super().stop(request)

    def finish(self, request) -> None:
        self.finished.append(request.request_id)
        super().finish(request)


def test_suffix_drafts_hear_of_requests_leaving_the_batch_and_ending(model):
    # A budget of 20 tokens for up to 8 rows of 1 + 6 drafts: rows left out of steps; 24 blocks: preemptions.
    prompts = prompts_of(4)
    prompts = [*prompts, *prompts]
    plain, _, _ = run(model, prompts, 16, num_blocks=24, budget=20)
    spy = SuffixSpy(6, 12, 10000, 1.0, 0.1, MAX_LEN)
    got, sched, _ = run(model, prompts, 16, spec=SpeculativeConfig(6, method="suffix"), oracle=spy, num_blocks=24, budget=20)
    assert got == plain
    assert sched.num_preemptions > 0 and sum(spy.stopped.values()) > sched.num_preemptions
    assert sorted(spy.finished) == sorted(plain)
    # Every response is cached, each once (a request back after a stop replaced its own).
    assert sorted(spy.cached) == sorted(plain) and len(spy.global_tree.seqs) == len(plain)
    assert sched.spec_stats.num_accepted_tokens > 0


@pytest.mark.parametrize("k", [1, 5])
def test_oracle_drafts_are_accepted_up_to_the_first_wrong_one_across_blocks(model, k):
    prompts = prompts_of(12)
    plain, _, _ = run(model, prompts, 30)
    # NOTE: 5 drafts of 4-token blocks: every verification writes into a block it appends.
    oracle = Oracle(plain, k, lambda request, call: (call * 7 + request.seq_id) % (k + 2))
    spec, sched, _ = run(model, prompts, 30, spec=SpeculativeConfig(k, 1, 1), oracle=oracle)
    assert spec == plain
    stats = sched.spec_stats
    # Every draft was verified (the budget holds them all), and accepted exactly up to its spoiled token.
    assert stats.num_drafts == oracle.calls
    assert stats.num_accepted_tokens == sum(oracle.expected_accepted) > 0
    assert stats.num_accepted_tokens_per_pos == [sum(1 for a in oracle.expected_accepted if a > i) for i in range(k)]


def test_only_verified_tokens_are_cached_and_a_later_hit_reads_right_kv(model):
    prompts = prompts_of(6)
    plain, _, _ = run(model, prompts, 24)

    def cached_within_verified(sched, kv, runner):
        for r in sched.running:
            n = kv.coordinator.num_cached_block[r.request_id]
            assert n * BS <= r.num_tokens  # no block holding a draft is hashed
            for block, h in zip(kv.req_to_blocks[r.request_id][:n], r.block_hashes, strict=False):
                assert block.block_hash is not None and block.block_hash == h

    oracle = Oracle(plain, 4, lambda request, call: call % 6)
    spec, sched, kv = run(model, prompts, 24, spec=SpeculativeConfig(4, 1, 1), oracle=oracle, check=cached_within_verified)
    assert spec == plain
    # A follow-up request over a finished one's whole sequence hits its blocks, verified by drafts,
    # and continues as it would without speculation anywhere (wrong K/V in a hit block would show).
    follow = [p + plain[f"r{j}"] for j, p in enumerate(prompts)]
    want, _, _ = run(model, follow, 8)
    got, sched2, kv2 = run(model, [*prompts, *follow], 8 + 24, spec=SpeculativeConfig(4, 1, 1),
                           oracle=Oracle({**{f"r{j}": plain[f"r{j}"] for j in range(6)},
                                          **{f"r{6 + j}": want[f"r{j}"] for j in range(6)}}, 4, lambda r, c: c % 6))
    assert [got[f"r{6 + j}"][:8] for j in range(6)] == [want[f"r{j}"] for j in range(6)]


def test_preemption_with_drafts_outstanding_changes_no_output(model):
    prompts = prompts_of(8)
    plain, _, _ = run(model, prompts, 28)
    oracle = Oracle(plain, 4, lambda request, call: 4 if call % 3 else call % 4)
    # 40 blocks for 8 requests of up to ~60 tokens (15 blocks each): preemptions while drafts are scheduled.
    spec, sched, _ = run(model, prompts, 28, spec=SpeculativeConfig(4, 1, 1), oracle=oracle, num_blocks=40)
    assert spec == plain
    assert sched.num_preemptions > 0 and sched.spec_stats.num_accepted_tokens > 0


def test_a_small_budget_drops_the_drafts_it_cannot_hold(model):
    prompts = prompts_of(8)
    plain, _, _ = run(model, prompts, 16)
    oracle = Oracle(plain, 5, lambda request, call: 5)
    spec, sched, _ = run(model, prompts, 16, spec=SpeculativeConfig(5, 1, 1), oracle=oracle, budget=20)
    assert spec == plain
    assert sched.spec_stats.num_draft_tokens < 5 * sched.spec_stats.num_drafts  # some were cut to fit the budget


def test_seeded_sampling_draws_the_same_tokens_with_and_without_drafts(model):
    prompts = prompts_of(10)

    def sampling(j):
        return SamplingParams(temperature=0.9, top_k=8, seed=1000 + j)

    plain, _, _ = run(model, prompts, 20, sampling=sampling)
    oracle = Oracle(plain, 3, lambda request, call: call % 5)
    spec, sched, _ = run(model, prompts, 20, spec=SpeculativeConfig(3, 1, 1), oracle=oracle, sampling=sampling)
    assert spec == plain and sched.spec_stats.num_accepted_tokens > 0


def _chi_square_bound(df: int, z: float = 3.719) -> float:
    """Wilson-Hilferty's upper quantile of chi-square with ``df`` degrees of freedom (z = 3.719: 1e-4)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@torch.inference_mode()
def test_sampled_outputs_keep_the_models_distribution(model):
    """Unseeded sampling (temperature 1, top-k 3) of three tokens after one prompt, drafts always
    the most likely path: the empirical joint distribution of the three tokens over many
    requests matches the model's, computed exactly by full forwards over every path."""
    prompt = [(11 * i) % 480 + 2 for i in range(9)]

    def next_probs(tokens):
        """The top 3 tokens after ``tokens`` and their renormalised probabilities: one prefill, no drafts."""
        c = model.config
        caches = allocate_kv_caches(c.num_layers, 32, BS, c.num_kv_heads, c.head_dim, torch.float32, "cpu")
        r = ModelRunner(model, caches, 1, MAX_LEN)
        sched = Scheduler(KVCacheManager(32, BS, MAX_LEN, enable_caching=False), 1, 256, MAX_LEN)
        sched.add_request(Request("x", tokens, 1, seq_id=0, ignore_eos=True))
        out = sched.schedule()
        logits = r.execute(out.plan).logits[0].float()
        values, ids = logits.topk(3)
        return dict(zip(ids.tolist(), torch.softmax(values, 0).tolist(), strict=True))

    exact: dict[tuple[int, ...], float] = {}
    for a, pa in next_probs(prompt).items():
        for b, pb in next_probs([*prompt, a]).items():
            for c, pc in next_probs([*prompt, a, b]).items():
                exact[(a, b, c)] = pa * pb * pc
    best = max(exact, key=exact.get)
    n = 900
    answers = {f"r{j}": list(best) for j in range(n)}
    oracle = Oracle(answers, 2, lambda request, call: 9)
    outs, sched, _ = run(model, [prompt] * n, 3, spec=SpeculativeConfig(2, 1, 1), oracle=oracle, max_num_seqs=64, budget=512,
                         num_blocks=64 * 4 + 8, sampling=lambda j: SamplingParams(temperature=1.0, top_k=3))
    assert sched.spec_stats.num_accepted_tokens > 0 and sched.spec_stats.num_accepted_tokens < sched.spec_stats.num_draft_tokens
    seen = Counter(tuple(o) for o in outs.values())
    assert set(seen) <= set(exact)
    chi2 = sum((seen.get(path, 0) - n * p) ** 2 / (n * p) for path, p in exact.items())
    assert chi2 < _chi_square_bound(len(exact) - 1), (chi2, seen, exact)
