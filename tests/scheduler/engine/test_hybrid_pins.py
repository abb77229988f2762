"""POST /v1/cache/pin with hybrid KV-cache groups (HttpSide.pin over a KVCacheManager of
several groups): the prompt's blocks are named missing until served, then pinned in
every group; the answer counts the prompt's blocks and tokens, the gauge pool blocks."""

from __future__ import annotations

import json
from types import SimpleNamespace

from protocol.client_messages import PinPrefix
from scheduler.core.hashing import BlockHasher
from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.engine.http_server import HttpSide
from scheduler.sched.request import Request


def test_a_hybrid_pin_holds_the_prompt_in_every_group_and_unpin_releases_it():
    kv = KVCacheManager(16, 4, 64, group_windows=[512, 0])
    hasher = BlockHasher(4)
    side = SimpleNamespace(state=SimpleNamespace(kv=kv), hasher=hasher)
    prompt = list(range(12))
    status, body = HttpSide.pin(side, PinPrefix(prompt), unpin=False)
    assert status == 200 and json.loads(body) == {"pinned_blocks": 0, "pinned_tokens": 0, "missing_blocks": 3, "block_size": 4}
    r = Request("a", prompt, max_tokens=1, block_hasher=hasher)
    assert kv.allocate_slots(r, 12) is not None
    kv.free(r)
    status, body = HttpSide.pin(side, PinPrefix(prompt), unpin=False)
    assert status == 200 and json.loads(body) == {"pinned_blocks": 3, "pinned_tokens": 12, "missing_blocks": 0, "block_size": 4}
    # Full attention's 3 blocks, and the sliding group's 2 ending at the replay boundary 11.
    assert kv.pinned.num_pinned_blocks == 5
    kv.check_invariants()
    status, body = HttpSide.pin(side, PinPrefix(prompt), unpin=True)
    assert status == 200 and json.loads(body)["pinned_blocks"] == 3
    assert kv.pinned.num_pinned_blocks == 0 and kv.pinned.num_refusals == 0
    kv.check_invariants()
