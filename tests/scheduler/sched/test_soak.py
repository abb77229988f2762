"""Soak: thousands of requests through Scheduler + KVCacheManager + FakeWorker.

Random prompt lengths (many sharing prefixes), random max_tokens, random arrival
steps, random client aborts (between steps and while a step is in flight, as the
process's client loop can do), a pool small enough for preemption storms and a
token budget that changes phase by phase (small budgets chunk prefills).

The FakeWorker checks the contract on every plan (rows append-only, no full block
written twice, every token reads its own KV). At the end: nothing leaked, the pool's
invariants hold, and every request either finished by itself with the right number
of tokens or was aborted by the test.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from kvtest.fake_worker import FakeWorker

from scheduler.core.hashing import BlockHasher
from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.sched.request import Request, RequestStatus
from scheduler.sched.scheduler import Scheduler

pytestmark = pytest.mark.timeout(120)

VOCAB = 64
EOS = 1
BLOCK = 4
MAX_MODEL_LEN = 128
# Budgets the run cycles through, one per phase of PHASE_STEPS steps.
BUDGETS = (3, 7, 16, 64, 512)
PHASE_STEPS = 300


@dataclass
class Spec:
    request_id: str
    prompt: list[int]
    max_tokens: int
    ignore_eos: bool
    arrive_step: int
    # Abort after this many steps alive (None: never); mid_step: while a step is in flight.
    abort_after: int | None
    mid_step: bool


def make_specs(rng: random.Random, n: int, num_blocks: int) -> list[Spec]:
    prefixes = [[rng.randrange(2, VOCAB) for _ in range(rng.randrange(1, 8) * BLOCK)] for _ in range(12)]
    specs = []
    for i in range(n):
        shared = rng.choice(prefixes) if rng.random() < 0.6 else []
        prompt = shared + [rng.randrange(0, VOCAB) for _ in range(rng.randrange(1, 40))]
        max_tokens = rng.choice((1, 2, rng.randrange(1, 16), rng.randrange(1, 60)))
        max_tokens = min(max_tokens, MAX_MODEL_LEN - len(prompt))
        # The process refuses requests over the pool (validation.py); the soak keeps to those it accepts.
        assert -(-(len(prompt) + max_tokens - 1) // BLOCK) <= num_blocks - 1
        specs.append(
            Spec(
                f"r{i}", prompt, max_tokens, ignore_eos=rng.random() < 0.7, arrive_step=rng.randrange(0, n),
                abort_after=rng.randrange(0, 40) if rng.random() < 0.15 else None, mid_step=rng.random() < 0.5,
            )
        )
    return specs


@pytest.mark.parametrize("seed, num_blocks, caching", [(11, 36, True), (12, 34, False)])
def test_soak_no_leak_every_request_accounted_for(seed, num_blocks, caching):
    rng = random.Random(seed)
    n = 3000 if caching else 1200
    specs = make_specs(rng, n, num_blocks)
    hasher = BlockHasher(BLOCK)
    kv = KVCacheManager(num_blocks, BLOCK, MAX_MODEL_LEN, enable_caching=caching)
    sched = Scheduler(kv, max_num_seqs=16, max_num_batched_tokens=BUDGETS[0], max_model_len=MAX_MODEL_LEN)
    worker = FakeWorker(num_blocks, BLOCK, VOCAB)

    pending = sorted(specs, key=lambda s: s.arrive_step)
    by_id = {s.request_id: s for s in specs}
    born: dict[str, int] = {}
    outputs: dict[str, list[int]] = {s.request_id: [] for s in specs}
    reasons: dict[str, str] = {}
    aborted_by_test: set[str] = set()
    # seq_ids of rows that ended while on the worker since the last plan: the next
    # plan drops them, so until then the worker may still hold them.
    ended_on_worker: set[int] = set()
    max_waiting = 0

    def abort_due(step: int, mid_step: bool) -> None:
        due = [rid for rid, r in sched.requests.items()
               if (s := by_id[rid]).abort_after is not None and s.mid_step == mid_step and step - born[rid] >= s.abort_after]
        for r in sched.finish_requests(due, RequestStatus.FINISHED_ABORTED):
            assert r.status == RequestStatus.FINISHED_ABORTED
            aborted_by_test.add(r.request_id)
            reasons[r.request_id] = "abort"
            if r.seq_id in worker.rows:
                ended_on_worker.add(r.seq_id)

    step = 0
    for step in range(200_000):
        if step % PHASE_STEPS == 0:
            # NOTE: the budget is read afresh by every schedule(); changing it between
            # steps is how this run gets both chunked-prefill and wide phases.
            sched.max_num_batched_tokens = BUDGETS[(step // PHASE_STEPS) % len(BUDGETS)]
        while pending and pending[0].arrive_step <= step:
            s = pending.pop(0)
            sched.add_request(Request(s.request_id, s.prompt, s.max_tokens, seq_id=len(born), ignore_eos=s.ignore_eos,
                                      eos_token_id=EOS, block_hasher=hasher))
            born[s.request_id] = step
        abort_due(step, mid_step=False)
        max_waiting = max(max_waiting, sched.num_waiting)

        out = sched.schedule()
        if out is not None:
            ended_on_worker -= set(out.plan.finished_seq_ids) | set(out.plan.preempted_seq_ids)
            result = worker.execute(out.plan)
            abort_due(step, mid_step=True)  # the client loop runs while the worker computes
            outs = sched.update_from_output(result)
            for i, (r, token_id) in enumerate(zip(outs.requests, outs.token_ids, strict=True)):
                rid = r.request_id
                assert rid not in aborted_by_test, f"{rid} got tokens after its abort"
                outputs[rid].append(token_id)
                if i in outs.finish_reasons:
                    reasons[rid] = outs.finish_reasons[i]
                    ended_on_worker.add(r.seq_id)
            running = {r.seq_id for r in sched.running}
            assert running <= set(worker.rows)
            assert set(worker.rows) - running <= ended_on_worker
            for r in sched.running:
                assert worker.rows[r.seq_id].block_ids == kv.get_block_ids(r.request_id)[0]
        if step % 50 == 0:
            kv.check_invariants()
        if not pending and not sched.has_unfinished_requests():
            break
    else:
        raise AssertionError(f"not drained: {len(sched.requests)} live, {len(pending)} not arrived")

    # Nothing leaked.
    kv.check_invariants()
    pool = kv.block_pool
    assert kv.usage == 0.0
    assert pool.get_num_free_blocks() == num_blocks - 1
    assert all(b.ref_cnt == 0 for b in pool.blocks[1:])
    assert not kv.req_to_blocks and not kv.coordinator.num_cached_block
    assert not sched.requests and not sched.running and not sched.waiting and not sched.seq_id_to_request
    # The worker holds only rows that ended since the last plan (the next one drops them).
    assert set(worker.rows) <= ended_on_worker
    if not caching:
        assert pool.num_free_cached_blocks == 0 and not any(b.block_hash for b in pool.blocks)

    # Every request is accounted for.
    assert set(reasons) == set(by_id)
    for rid, s in by_id.items():
        out = outputs[rid]
        if rid in aborted_by_test:
            assert reasons[rid] == "abort" and len(out) < s.max_tokens
        elif reasons[rid] == "length":
            assert len(out) == s.max_tokens, rid
        else:
            assert reasons[rid] == "stop" and not s.ignore_eos, rid
            assert out[-1] == EOS and EOS not in out[:-1] and len(out) <= s.max_tokens, rid

    # It was a storm, not a drizzle.
    assert sched.num_preemptions > n // 10, sched.num_preemptions
    assert len(aborted_by_test) > n // 20
    assert max_waiting > 16
    assert step > 2 * PHASE_STEPS * len(BUDGETS)
