"""POST /v1/cache/pin with hybrid KV-cache groups: a 400 naming them (HttpSide.pin over
a KVCacheManager of several groups); unpinning answers that nothing was pinned."""

from __future__ import annotations

import json
from types import SimpleNamespace

from protocol.client_messages import PinPrefix
from scheduler.core.hashing import BlockHasher
from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.engine.http_server import HttpSide


def test_a_pin_is_refused_with_a_400_naming_hybrid_groups():
    kv = KVCacheManager(16, 4, 64, group_windows=[512, 0])
    side = SimpleNamespace(state=SimpleNamespace(kv=kv), hasher=BlockHasher(4))
    status, body = HttpSide.pin(side, PinPrefix(list(range(12))), unpin=False)
    assert status == 400 and "hybrid KV-cache groups" in json.loads(body)["error"]
    assert kv.pinned.num_refusals == 1 and kv.usage == 0.0
    status, body = HttpSide.pin(side, PinPrefix(list(range(12))), unpin=True)
    assert status == 200 and json.loads(body)["pinned_blocks"] == 0
