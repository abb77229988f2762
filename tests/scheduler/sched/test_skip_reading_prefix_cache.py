"""vLLM's skip_reading_prefix_cache: a request for prompt logprobs finds no prefix hit
(every prompt position must be computed to be scored), is not counted in the
prefix-cache stats at all (vLLM's ``record_prefix_cache_stats`` skips it), and still
caches its own full blocks for the requests after it. Counts by hand, block size 4."""

from __future__ import annotations

from kvtest.fake_worker import FakeWorker

from protocol.sampling_params import SamplingParams
from scheduler.core.hashing import BlockHasher
from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.sched.request import Request
from scheduler.sched.scheduler import Scheduler

BS = 4
PROMPT = list(range(2, 14))  # 12 tokens: 3 full blocks


def run_alone(s: Scheduler, w: FakeWorker, request: Request) -> list:
    s.add_request(request)
    plans = []
    while s.has_unfinished_requests():
        out = s.schedule()
        plans.append(out.plan)
        s.update_from_output(w.execute(out.plan))
    return plans


def test_prompt_logprobs_request_reads_nothing_counts_nothing_and_writes_its_blocks():
    kv = KVCacheManager(40, BS, 256)
    s = Scheduler(kv, 8, 64, 256)
    w = FakeWorker(40, BS, 64)
    hasher = BlockHasher(BS)
    plain = Request("a", PROMPT, 2, seq_id=0, block_hasher=hasher)
    run_alone(s, w, plain)
    # a: 12 tokens queried, nothing cached before it.
    assert (kv.prefix_cache_stats.requests, kv.prefix_cache_stats.queries, kv.prefix_cache_stats.hits) == (1, 12, 0)

    b = Request("b", PROMPT, 2, seq_id=1, block_hasher=hasher, sampling=SamplingParams(prompt_logprobs=0))
    assert b.skip_reading_prefix_cache
    hits, n = kv.get_computed_blocks(b)
    assert (hits.blocks, n) == (([],), 0)
    plans = run_alone(s, w, b)
    # b's whole prompt computed from position 0 though a's 2 usable blocks are cached;
    # and the stats did not move (neither its lookup at admission nor the one above).
    assert plans[0].new_rows[0].num_computed_tokens == 0 and plans[0].num_scheduled_tokens[1] == 12
    assert b.num_cached_tokens == 0
    assert (kv.prefix_cache_stats.requests, kv.prefix_cache_stats.queries, kv.prefix_cache_stats.hits) == (1, 12, 0)

    # c (plain) after them: hits (12 - 1) // 4 = 2 blocks = 8 tokens (the last token is always computed).
    c = Request("c", PROMPT, 2, seq_id=2, block_hasher=hasher)
    plans = run_alone(s, w, c)
    assert plans[0].new_rows[0].num_computed_tokens == 8
    assert (kv.prefix_cache_stats.requests, kv.prefix_cache_stats.queries, kv.prefix_cache_stats.hits) == (2, 24, 8)


def test_its_blocks_are_cached_for_others():
    """b alone in a fresh pool: what c hits afterwards can only be b's blocks."""
    kv = KVCacheManager(40, BS, 256)
    s = Scheduler(kv, 8, 64, 256)
    w = FakeWorker(40, BS, 64)
    hasher = BlockHasher(BS)
    run_alone(s, w, Request("b", PROMPT, 2, seq_id=0, block_hasher=hasher, sampling=SamplingParams(prompt_logprobs=3)))
    assert (kv.prefix_cache_stats.requests, kv.prefix_cache_stats.queries) == (0, 0)
    plans = run_alone(s, w, Request("c", PROMPT + [20], 2, seq_id=1, block_hasher=hasher))
    # 13 tokens: (13 - 1) // 4 = 3 blocks may hit, and b cached all 3.
    assert plans[0].new_rows[0].num_computed_tokens == 12
    assert (kv.prefix_cache_stats.requests, kv.prefix_cache_stats.queries, kv.prefix_cache_stats.hits) == (1, 13, 12)


def test_parts_are_joined_and_dropped_on_requeue():
    """The worker's parts, joined on the request until its first token takes them whole;
    a request requeued before its first token is scored afresh: its parts are dropped."""
    from protocol.prompt_logprobs import PromptLogprobs
    from protocol.worker_messages import StepResult
    from scheduler.sched.prompt_logprobs import gather_prompt_logprobs

    r = Request("b", PROMPT, 2, seq_id=7, sampling=SamplingParams(prompt_logprobs=1))
    reqs = {7: r}
    p1 = PromptLogprobs([-1.0, -2.0], [3, 1], [[5], [6]], [[-0.5], [-2.0]])
    p2 = PromptLogprobs([-3.0], [9], [[4]], [[-0.1]])
    assert gather_prompt_logprobs(reqs, StepResult(0, prompt_logprobs={7: p1})) == {}
    whole = gather_prompt_logprobs(reqs, StepResult(1, [7], [40], prompt_logprobs={7: p2, 8: p2}))
    assert whole == {7: PromptLogprobs([-1.0, -2.0, -3.0], [3, 1, 9], [[5], [6], [4]], [[-0.5], [-2.0], [-0.1]])}
    assert r.prompt_logprobs is None
    # A part, then a requeue (preemption or a lost worker) before the first token.
    r = Request("c", PROMPT, 2, seq_id=8, block_hasher=BlockHasher(BS), sampling=SamplingParams(prompt_logprobs=1))
    s = Scheduler(KVCacheManager(40, BS, 256), 8, 64, 256)
    s.add_request(r)
    s.schedule()
    gather_prompt_logprobs(s.seq_id_to_request, StepResult(0, prompt_logprobs={8: p1}))
    assert r.prompt_logprobs == p1
    s._requeue(r)
    assert r.prompt_logprobs is None
