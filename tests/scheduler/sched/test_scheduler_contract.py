"""The scheduling policy against an in-process fake worker that checks the
contract on every plan, over randomized workloads: small pools (preemptions),
small budgets (chunked prefill), caching on and off, aborts.

Outputs are a deterministic function of each request's tokens (see
kvtest.fake_worker), so every configuration must produce the same outputs.
"""

from __future__ import annotations

import random

import pytest
from kvtest.fake_worker import ContractViolation, FakeWorker

from protocol.worker_messages import StepPlan
from scheduler.core.hashing import BlockHasher
from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.core.offload.offload_tier import HostTier
from scheduler.sched.priority_scheduler import scheduler_class
from scheduler.sched.request import Request, RequestStatus
from scheduler.sched.scheduler import Scheduler

VOCAB = 64
EOS = 1


def make_workload(seed: int, n: int, block_size: int) -> list[dict]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(2, VOCAB) for _ in range(rng.randrange(1, 4) * block_size)] for _ in range(3)]
    reqs = []
    for i in range(n):
        prompt = (rng.choice(prefixes) if rng.random() < 0.7 else []) + [rng.randrange(2, VOCAB) for _ in range(rng.randrange(1, 20))]
        reqs.append(
            dict(
                request_id=f"r{i}", prompt=prompt, max_tokens=rng.randrange(1, 24), ignore_eos=rng.random() < 0.5,
                arrive_step=rng.randrange(0, n // 2 + 1), abort_step=(rng.randrange(1, 30) if rng.random() < 0.1 else None),
            )
        )
    return reqs


def run(workload, *, num_blocks, block_size=4, max_num_seqs=8, budget=64, caching=True, max_model_len=256, check=True,
        num_host_blocks=0, offload_store="eviction", policy="fcfs", **options):
    """``options``: the Scheduler's policy options (long_prefill_token_threshold, ...)."""
    hasher = BlockHasher(block_size)
    tier = HostTier(num_host_blocks, block_size) if num_host_blocks else None
    kv = KVCacheManager(num_blocks, block_size, max_model_len, enable_caching=caching, host_tier=tier, offload_store=offload_store)
    sched = scheduler_class(policy)(kv, max_num_seqs, budget, max_model_len, **options)
    worker = FakeWorker(num_blocks, block_size, VOCAB, num_host_blocks=num_host_blocks)
    outputs: dict[str, list[int]] = {w["request_id"]: [] for w in workload}
    reasons: dict[str, str] = {}
    step = 0
    pending = sorted(workload, key=lambda w: w["arrive_step"])
    live_since: dict[str, int] = {}
    num_plans = 0
    for _ in range(10_000):
        while pending and pending[0]["arrive_step"] <= step:
            w = pending.pop(0)
            req = Request(w["request_id"], w["prompt"], w["max_tokens"], seq_id=len(live_since), ignore_eos=w["ignore_eos"],
                          eos_token_id=EOS, block_hasher=hasher, priority=w.get("priority", 0))
            sched.add_request(req)
            live_since[w["request_id"]] = step
        for w in workload:
            a = w["abort_step"]
            if a is not None and w["request_id"] in sched.requests and step - live_since[w["request_id"]] == a:
                for r in sched.finish_requests([w["request_id"]], RequestStatus.FINISHED_ABORTED):
                    reasons[r.request_id] = "abort"
        out = sched.schedule()
        if out is not None:
            check_plan(out, sched, kv, num_plans, max_num_seqs, budget)
            num_plans += 1
            result = worker.execute(out.plan)
            outs = sched.update_from_output(result)
            for i, (r, token_id) in enumerate(zip(outs.requests, outs.token_ids, strict=True)):
                outputs[r.request_id].append(token_id)
                if i in outs.finish_reasons:
                    reasons[r.request_id] = outs.finish_reasons[i]
            # The worker's rows equal the scheduler's block tables and tokens.
            for req in sched.running:
                row = worker.rows[req.seq_id]
                assert row.block_ids == kv.get_block_ids(req.request_id)[0]
                assert row.token_ids == req.all_token_ids
            if check:
                kv.check_invariants()
        step += 1
        if not pending and not sched.has_unfinished_requests():
            break
    else:
        raise AssertionError("workload did not drain")
    assert kv.usage == 0.0
    assert len(sched.running) == 0 and len(sched.waiting) == 0
    if kv.host_tier is not None:
        # Idle: no slot pinned, so no copy in flight (a store or load pins its slot).
        assert kv.host_tier.get_usage() == 0.0
    return outputs, reasons, sched, kv


def check_plan(out, sched: Scheduler, kv: KVCacheManager, num_plans: int, max_num_seqs: int, budget: int) -> None:
    """What a plan must say about the step just scheduled (the fake worker checks
    the plans against each other; this checks one against the scheduler)."""
    plan = out.plan
    assert type(plan) is StepPlan and plan.step_id == num_plans
    # Within the batch bounds, and the plan's counts (default 1) add up to the step's.
    assert 0 < len(out.scheduled) <= max_num_seqs
    counts = [plan.num_scheduled_tokens.get(r.seq_id, 1) for r in out.scheduled]
    assert all(c > 0 for c in counts) and sum(counts) == out.num_scheduled_tokens <= budget
    scheduled_ids = {r.seq_id for r in out.scheduled}
    assert all(n == 0 or seq_id in scheduled_ids for seq_id, n in plan.num_scheduled_tokens.items())
    # Victims hold nothing, wait to be recomputed, and are named in the plan.
    assert plan.preempted_seq_ids == [r.seq_id for r in out.preempted]
    for r in out.preempted:
        assert r.status == RequestStatus.PREEMPTED and r.num_computed_tokens == 0 and r.request_id not in kv.req_to_blocks
        assert r in sched.waiting and r.seq_id not in scheduled_ids
    # A row sent whole carries the request's whole table and tokens, as now.
    by_seq = {r.seq_id: r for r in out.scheduled}
    for row in plan.new_rows + plan.resumed_rows:
        r = by_seq[row.seq_id]
        assert row.block_ids == kv.get_block_ids(r.request_id)[0] and row.token_ids == r.all_token_ids
    # Every request that samples is scheduled and has computed all its tokens.
    assert all(r.seq_id in scheduled_ids and r.num_computed_tokens == r.num_tokens for r in out.sampling)


@pytest.mark.parametrize("seed", range(6))
def test_random_workloads_obey_the_contract_and_agree_across_configs(seed):
    wl = make_workload(seed, 40, 4)
    # Aborts depend on timing; compare only the configurations' non-aborted outputs.
    ref_out, ref_reasons, _, _ = run([dict(w, abort_step=None) for w in wl], num_blocks=2000, budget=4096, caching=False, max_num_seqs=64)
    for kwargs in (
        dict(num_blocks=2000, budget=4096, caching=True, max_num_seqs=64),
        dict(num_blocks=24, budget=64, caching=True),  # preemptions
        dict(num_blocks=24, budget=64, caching=False),
        dict(num_blocks=40, budget=5, caching=True),  # chunked prefill
        dict(num_blocks=16, budget=7, caching=True, max_num_seqs=3),
    ):
        out, reasons, sched, kv = run(wl, **kwargs)
        for w in wl:
            rid = w["request_id"]
            if reasons[rid] == "abort":
                assert ref_out[rid][: len(out[rid])] == out[rid]
            else:
                assert out[rid] == ref_out[rid], (kwargs, rid)
                assert reasons[rid] == ref_reasons[rid]
                n = len(out[rid])
                assert n == w["max_tokens"] or (reasons[rid] == "stop" and out[rid][-1] == EOS)


def test_small_pools_do_preempt_and_small_budgets_do_chunk():
    wl = make_workload(1, 40, 4)
    _, _, sched, _ = run(wl, num_blocks=24, budget=64)
    assert sched.num_preemptions > 0
    chunked = []
    kv = KVCacheManager(40, 4, 256)
    s = Scheduler(kv, 8, 5, 256)
    s.add_request(Request("a", list(range(2, 14)), 2, block_hasher=BlockHasher(4)))
    w = FakeWorker(40, 4, VOCAB)
    while s.has_unfinished_requests():
        out = s.schedule()
        chunked.append(out.plan.num_scheduled_tokens.get(0, 1))
        s.update_from_output(w.execute(out.plan))
    assert chunked == [5, 5, 2, 1]


def test_resumed_requests_are_counted_apart_in_prefix_cache_stats():
    # As vLLM: vllm:prefix_cache_queries/hits count each request's first admission
    # only; a victim's re-admission (which hits its own freed blocks) goes apart.
    wl = [dict(w, abort_step=None) for w in make_workload(1, 40, 4)]
    _, _, sched, kv = run(wl, num_blocks=24, budget=64)
    stats = kv.prefix_cache_stats
    assert sched.num_preemptions > 0
    assert stats.requests == 40
    assert stats.queries == sum(len(w["prompt"]) for w in wl)
    assert stats.preempted_requests == sched.num_preemptions
    assert stats.preempted_queries > 0 and stats.preempted_hits > 0


def test_unchanged_decode_steps_send_tiny_plans():
    kv = KVCacheManager(4096, 16, 4096)
    s = Scheduler(kv, 256, 1 << 20, 4096)
    w = FakeWorker(4096, 16, VOCAB, check_reads=False)
    for i in range(256):
        s.add_request(Request(f"r{i}", [2 + (i % 50)] * 20, 30, seq_id=i, ignore_eos=True, block_hasher=BlockHasher(16)))
    sizes = []
    from protocol.codec import Codec
    from protocol.worker_messages import SchedulerToWorker

    codec = Codec(SchedulerToWorker)
    for _ in range(8):
        out = s.schedule()
        sizes.append(len(codec.encode(out.plan)))
        s.update_from_output(w.execute(out.plan))
    # Step 0 admits everyone; later steps decode 256 rows, and tokens 21..32 need no new block
    # (positions 20..31 are in block 1, which arrived at admission).
    assert sizes[0] > 256 * 20
    assert all(size <= 64 for size in sizes[2:]), sizes


def test_fake_worker_catches_breaches():
    kv = KVCacheManager(40, 4, 256)
    s = Scheduler(kv, 8, 64, 256)
    s.add_request(Request("a", list(range(2, 10)), 5, block_hasher=BlockHasher(4)))
    w = FakeWorker(40, 4, VOCAB)
    out = s.schedule()
    s.update_from_output(w.execute(out.plan))
    out = s.schedule()
    # A gap in step ids.
    bad = StepPlan(step_id=out.plan.step_id + 1)
    with pytest.raises(ContractViolation, match="expected"):
        w.execute(bad)
    # A row sent whole twice.
    w2 = FakeWorker(40, 4, VOCAB)
    kv2 = KVCacheManager(40, 4, 256)
    s2 = Scheduler(kv2, 8, 64, 256)
    s2.add_request(Request("a", list(range(2, 10)), 5, block_hasher=BlockHasher(4)))
    first = s2.schedule().plan
    w2.execute(first)
    with pytest.raises(ContractViolation, match="sent whole only once"):
        w2.execute(StepPlan(step_id=1, new_rows=first.new_rows))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("offload_store", ["eviction", "full"])
def test_the_host_tier_keeps_outputs_and_the_contract(seed, offload_store):
    # The fake worker runs the plan's copies (stores, then loads) on its model of
    # the KV slots and checks every read: a load of the wrong data, or a store
    # after its block was reused, fails the step.
    wl = make_workload(seed, 40, 4)
    ref_out, ref_reasons, _, _ = run([dict(w, abort_step=None) for w in wl], num_blocks=2000, budget=4096, caching=False, max_num_seqs=64)
    num_loads = 0
    for kwargs in (
        dict(num_blocks=24, budget=64, num_host_blocks=64),  # preemptions
        dict(num_blocks=40, budget=5, num_host_blocks=8),  # chunked prefill, a host tier smaller than the device pool
        dict(num_blocks=16, budget=7, max_num_seqs=3, num_host_blocks=3),
    ):
        out, reasons, sched, kv = run(wl, offload_store=offload_store, **kwargs)
        num_loads += kv.host_tier.num_loads
        for w in wl:
            rid = w["request_id"]
            if reasons[rid] == "abort":
                assert ref_out[rid][: len(out[rid])] == out[rid]
            else:
                assert out[rid] == ref_out[rid], (kwargs, rid)
                assert reasons[rid] == ref_reasons[rid]
    assert num_loads > 0


def cycling_workload(num_prefixes: int, rounds: int, prefix_blocks: int, block_size: int = 4) -> list[dict]:
    """Each prefix in turn, ``rounds`` times: a working set of num_prefixes x prefix_blocks."""
    prefixes = [[2 + p] + [10 + (p * 7 + i) % 50 for i in range(prefix_blocks * block_size - 1)] for p in range(num_prefixes)]
    return [
        dict(request_id=f"r{r}-{p}", prompt=prefixes[p] + [3, 4 + r], max_tokens=2, ignore_eos=True, arrive_step=0, abort_step=None)
        for r in range(rounds) for p in range(num_prefixes)
    ]


@pytest.mark.parametrize("offload_store", ["eviction", "full"])
def test_a_working_set_over_the_device_pool_hits_in_the_host_tier(offload_store):
    # 6 prefixes of 8 blocks: 48 blocks of working set; the device pool holds 20
    # (about two prefixes), the host tier 64. One request at a time, cycling: the
    # device alone misses every prefix again; with the tier the later rounds load it.
    wl = cycling_workload(6, 3, 8)
    ref_out, _, _, no_tier = run(wl, num_blocks=20, max_num_seqs=1)
    out, _, _, kv = run(wl, num_blocks=20, max_num_seqs=1, num_host_blocks=64, offload_store=offload_store)
    assert out == ref_out
    queries = kv.prefix_cache_stats.queries
    assert queries == no_tier.prefix_cache_stats.queries == sum(len(w["prompt"]) for w in wl)
    hits_without = no_tier.prefix_cache_stats.hits
    hits_with = kv.prefix_cache_stats.hits + kv.external_prefix_cache_stats.hits
    assert hits_with > hits_without
    # Rounds 2 and 3 find every prefix (32 tokens each) on the device or the host.
    assert hits_with >= 2 * 6 * 32
    ext = kv.external_prefix_cache_stats
    assert ext.hits > 0 and ext.queries == queries - kv.prefix_cache_stats.hits
    assert kv.host_tier.num_loads * 4 == ext.hits


def with_priorities(workload: list[dict], seed: int) -> list[dict]:
    rng = random.Random(seed + 1000)
    return [dict(w, priority=rng.randrange(-2, 3)) for w in workload]


@pytest.mark.parametrize("seed", range(6))
def test_the_priority_policy_and_the_long_prefill_cap_keep_outputs_and_the_contract(seed):
    # Priority preemption takes victims wherever they stand in `running`, also ones
    # scheduled earlier in the step: the fake worker fails any read of KV that was
    # never written (a victim's blocks cached for the step it left), any append to a
    # dropped row, and any count that does not add up.
    wl = with_priorities(make_workload(seed, 40, 4), seed)
    ref_out, ref_reasons, _, _ = run([dict(w, abort_step=None) for w in wl], num_blocks=2000, budget=4096, caching=False, max_num_seqs=64)
    num_preemptions = 0
    for kwargs in (
        dict(num_blocks=24, budget=64, policy="priority"),  # preemptions
        dict(num_blocks=24, budget=64, policy="priority", caching=False),
        dict(num_blocks=16, budget=7, max_num_seqs=3, policy="priority"),
        dict(num_blocks=24, budget=64, policy="priority", num_host_blocks=16, offload_store="full"),
        dict(num_blocks=24, budget=64, policy="priority", long_prefill_token_threshold=5),
        dict(num_blocks=24, budget=64, long_prefill_token_threshold=3, long_prefill_token_threshold_adaptive=True),
        dict(num_blocks=24, budget=256, max_model_len=256, enable_chunked_prefill=False),
        dict(num_blocks=24, budget=256, policy="priority", enable_chunked_prefill=False, long_prefill_token_threshold=6),
    ):
        out, reasons, sched, kv = run(wl, **kwargs)
        num_preemptions += sched.num_preemptions if kwargs.get("policy") else 0
        for w in wl:
            rid = w["request_id"]
            if reasons[rid] == "abort":
                assert ref_out[rid][: len(out[rid])] == out[rid]
            else:
                assert out[rid] == ref_out[rid], (kwargs, rid)
                assert reasons[rid] == ref_reasons[rid]
    assert num_preemptions > 0
