"""KVCacheManager of several groups held against vLLM 0.32's own KVCacheManager (``-m compare``):
both, over the same hybrid groups (a full-attention group and sliding-window groups),
pool size and block size, caching on (and off), go through the same random admissions (prompts
sharing prefixes, chunked or whole, the admission gate on or off), prefill chunks,
decode steps, frees and preemptions; after every operation their answers (hit
length, new block ids per group), every request's block ids per group, the free
blocks, usage, prefix-cache counts and the prefix cache's (hash, group) keys are equal,
and our KV events are vLLM's (raw hash, group index, kind, window). vLLM's side:
tests/scheduler/core/data/vllm_hybrid_driver.py, run in .venv-vllm."""

from __future__ import annotations

import json
import os
import random
import subprocess

import pytest

from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.core.kv_events import BlockRemoved, BlockStored, KVEventRecorder
from scheduler.core.vllm_hashing import VllmBlockHasher
from scheduler.engine.kv_event_publisher import to_wire_event
from scheduler.sched.request import Request

pytestmark = [pytest.mark.compare, pytest.mark.timeout(600)]

# (windows, block_size, num_blocks, caching): full + sliding, sliding first, Gemma 3's
# shape (several groups of one window and a full one), two windows, one sliding group
# alone; and prefix caching off (vLLM's KVCacheCoordinatorNoPrefixCache).
CONFIGS = [
    ([0, 4], 2, 40, True),
    ([4, 0], 2, 40, True),
    ([8, 8, 0], 4, 48, True),
    ([4, 0, 7], 2, 64, True),
    ([6], 2, 24, True),
    ([0, 16], 4, 32, True),
    ([0, 4], 2, 40, False),
    ([5, 5, 0], 2, 48, False),
    ([0, 1], 2, 40, True),
]
SEEDS = range(4)
NUM_OPS = 120
MAX_MODEL_LEN = 80
MAX_BATCHED = 16


def random_ops(rng: random.Random, bs: int) -> list[list]:
    """A synchronous scheduler's calls: prompts from three shared prefixes."""
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(4, 24))] for _ in range(3)]
    ops: list[list] = []
    running: dict[str, int] = {}  # rid -> tokens so far (prompt + appended)
    preempted: set[str] = set()
    prompts: dict[str, list[int]] = {}
    next_id = 0
    for _ in range(NUM_OPS):
        roll = rng.random()
        if roll < 0.2 or not (running or preempted):
            rid = f"r{next_id}"
            next_id += 1
            prompt = rng.choice(prefixes)[: rng.randrange(1, 25)] + [
                rng.randrange(1000) for _ in range(rng.randrange(1, 20))
            ]
            prompts[rid] = prompt
            ops.append(["admit", rid, prompt, rng.choice([4, 8, 64]), rng.random() < 0.5])
        elif roll < 0.28 and preempted:
            rid = rng.choice(sorted(preempted))
            ops.append(["admit", rid, prompts[rid], rng.choice([4, 8, 64]), rng.random() < 0.5])
        elif roll < 0.78 and running:
            ops.append(
                [
                    "step",
                    rng.choice(sorted(running)),
                    rng.choice([1, 1, 1, 3, 8]),
                    rng.randrange(1000),
                ]
            )
        elif roll < 0.93 and running:
            ops.append(["free", rng.choice(sorted(running))])
        elif running:
            ops.append(["preempt", rng.choice(sorted(running))])
        # Which requests run is known only once the managers answered: both drivers
        # skip an op on a request they do not hold, so track a superset here.
        if ops[-1][0] == "admit":
            running[ops[-1][1]] = 1
            preempted.discard(ops[-1][1])
        elif ops[-1][0] == "free":
            running.pop(ops[-1][1], None)
        elif ops[-1][0] == "preempt":
            running.pop(ops[-1][1], None)
            preempted.add(ops[-1][1])
    return ops


def run_ours(case: dict) -> list[dict]:
    bs = case["block_size"]
    # vLLM's own sha256 block hashes (PYTHONHASHSEED unset on both sides): equal keys.
    hasher = VllmBlockHasher(bs, "sha256", None)
    events = KVEventRecorder()
    kv = KVCacheManager(case["num_blocks"], bs, case["max_model_len"], case["enable_caching"], events,
        group_windows=case["windows"],
        max_num_batched_tokens=case["max_num_batched_tokens"],
    )
    requests: dict[str, Request] = {}
    running: set[str] = set()
    out = []
    for op in case["ops"]:
        kind, rid = op[0], op[1]
        result = None
        if (kind == "admit") == (rid in running):
            result = "skip"  # an op on a request the generator only guessed was (not) running
        elif kind == "admit":
            tokens, chunk, full_must_fit = op[2], op[3], op[4]
            r = requests.get(rid) or Request(rid, list(tokens), max_tokens=64, block_hasher=hasher)
            hits, n = kv.get_computed_blocks(r, record_stats=False)
            num_new = min(chunk, r.num_tokens - n)
            new = kv.allocate_slots(r, num_new, n, hits, full_sequence_must_fit=full_must_fit)
            if new is not None:
                kv.record_prefix_cache_query(r.num_tokens, n, r.num_preemptions > 0)
                r.num_computed_tokens = n + num_new
                requests[rid] = r
                running.add(rid)
            result = [n, None if new is None else new.get_block_ids()]
        elif kind == "step":
            r = requests[rid]
            if r.num_computed_tokens == r.num_tokens:
                r.append_output_token_ids([op[3]])
            num_new = min(op[2], r.num_tokens - r.num_computed_tokens)
            new = kv.allocate_slots(r, num_new)
            if new is not None:
                r.num_computed_tokens += num_new
            result = None if new is None else new.get_block_ids()
        elif kind == "free":
            running.discard(rid)
            kv.free(requests.pop(rid))
        elif kind == "preempt":
            running.discard(rid)
            r = requests[rid]
            kv.free(r)
            r.num_computed_tokens = 0
            r.num_preemptions += 1
        kv.check_invariants()
        stats = kv.prefix_cache_stats
        stored, removed = [], []
        for event in events.take_events():
            wire = to_wire_event(event, int_block_hashes=False)
            if isinstance(event, BlockStored):
                kind, window = wire.kv_cache_spec_kind, wire.kv_cache_spec_sliding_window
                stored += [[h.hex(), wire.group_idx, kind, window] for h in wire.block_hashes]
            elif isinstance(event, BlockRemoved):
                removed += [[h.hex(), wire.group_idx] for h in wire.block_hashes]
        out.append({
            "result": result,
            "tables": {k: kv.get_block_ids(k) for k in sorted(requests)},
            "free": kv.block_pool.get_num_free_blocks(),
            "usage": kv.usage,
            "queries": stats.queries,
            "hits": stats.hits,
            "preempted_queries": stats.preempted_queries,
            "preempted_hits": stats.preempted_hits,
            "keys": sorted(k.hex() for k in kv.block_pool.cached_block_hash_to_block.keys()),
            "stored": stored,
            "removed": removed,
        })
    return out


def cases() -> list[dict]:
    out = []
    for windows, bs, num_blocks, caching in CONFIGS:
        for seed in SEEDS:
            ops = random_ops(random.Random(f"{windows}/{seed}"), bs)
            out.append({"windows": windows, "block_size": bs, "num_blocks": num_blocks, "max_model_len": MAX_MODEL_LEN,
                        "max_num_batched_tokens": MAX_BATCHED, "enable_caching": caching, "ops": ops})
    return out


@pytest.fixture(scope="module")
def both(real_vllm):
    all_cases = cases()
    script = real_vllm / "tests/scheduler/core/data/vllm_hybrid_driver.py"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"} | {
        "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0"
    }
    proc = subprocess.run([str(real_vllm / ".venv-vllm/bin/python"), str(script)], input=json.dumps(all_cases),
                          capture_output=True, text=True, timeout=500, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    return all_cases, theirs


@pytest.mark.parametrize("index", range(len(CONFIGS) * len(SEEDS)))
def test_every_operation_leaves_the_same_state_as_vllms(both, index):
    all_cases, theirs = both
    case = all_cases[index]
    ours = run_ours(case)
    keys: set[str] = set()
    for i, (op, mine, vllms) in enumerate(zip(case["ops"], ours, theirs[index], strict=True)):
        where = f"{case['windows']} op {i}: {op[:2]} {op[3:]}"
        events = {k: (mine.pop(k), vllms.pop(k)) for k in ("stored", "removed")}
        assert mine == vllms, where
        # Events: ours replayed on the cache's keys give its keys (one stored per new
        # key, one removed per key gone); vLLM's say the same and more (a stored event
        # for a duplicate's block, a removed one for each block evicted), with the same
        # raw hash, group index, kind and window.
        stored = {(h, g, kind, w) for h, g, kind, w in events["stored"][0]}
        removed = {(h, g) for h, g in events["removed"][0]}
        assert stored <= {tuple(e) for e in events["stored"][1]}, where
        assert removed <= {tuple(e) for e in events["removed"][1]}, where
        keys -= {h + g.to_bytes(4, "big").hex() for h, g in removed}  # vLLM's BlockHashWithGroupId
        keys |= {h + g.to_bytes(4, "big").hex() for h, g, _, _ in stored}
        assert keys == set(vllms["keys"]), where
