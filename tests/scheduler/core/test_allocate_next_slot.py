"""KVCacheManager.allocate_next_slot, the scheduler's one-token path, against the
general allocate_slots."""

from __future__ import annotations

import random

from kvtest.kv_manager import admit, ids, manager, req, snapshot

from scheduler.sched.request import Request


def test_allocate_next_slot_is_allocate_slots_for_one_token():
    """The scheduler's decode path must be indistinguishable from the general one:
    two managers driven through the same random workload (shared prefixes, a pool
    small enough to run out, requests finishing at random, max_model_len reached),
    one calling allocate_slots(r, 1) and one allocate_next_slot(r), agree on every
    result, every block table, the free queue, the hash map, the counters and each
    request's alloc_noop_until, after every call."""
    for seed in range(40):
        rng = random.Random(seed)
        caching = seed % 4 != 3
        num_blocks = rng.randint(4, 12)
        pair = [manager(num_blocks=num_blocks, max_model_len=24, enable_caching=caching) for _ in range(2)]
        running: list[tuple[Request, Request]] = []
        for step in range(120):
            if len(running) < 3 and rng.random() < 0.3:
                prompt = [rng.randint(0, 2) for _ in range(rng.randint(1, 9))]
                twins = (req(f"s{seed}-{step}", prompt), req(f"s{seed}-{step}", prompt))
                results = [admit(m, r) for m, r in zip(pair, twins, strict=True)]
                assert ids(results[0][1] or []) == ids(results[1][1] or [])
                if results[0][1] is not None:
                    for r in twins:
                        r.append_output_token_id(r.num_tokens % 3)
                    running.append(twins)
            elif running:
                twins = running[rng.randrange(len(running))]
                slow, fast = twins
                done = rng.random() < 0.1 or slow.num_tokens > 25  # past max_model_len too
                got = None if done else (pair[0].allocate_slots(slow, 1), pair[1].allocate_next_slot(fast))
                if got is not None:
                    assert (got[0] is None) == (got[1] is None)
                    assert ids(got[0] or []) == ids(got[1] or [])
                    assert slow.alloc_noop_until == fast.alloc_noop_until
                if done or got[0] is None:
                    running.remove(twins)
                    for m, r in zip(pair, twins, strict=True):
                        m.free(r)
                else:
                    token = rng.randint(0, 2)
                    for r in twins:
                        r.num_computed_tokens += 1
                        r.append_output_token_id(token)
            assert snapshot(pair[0]) == snapshot(pair[1])
            pair[1].check_invariants()
