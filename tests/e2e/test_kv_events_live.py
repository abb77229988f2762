"""KV events from a real scheduler process: a subscriber rebuilds exactly the set
of hashes the prefix cache holds, and sees the reset."""

from __future__ import annotations

import random
import time
import urllib.request

import pytest
from kvtest.cluster import Cluster, free_port

from loadgen.kv_events import KVEventSubscriber
from protocol.client_messages import Generate
from protocol.kv_events import int_block_hash
from scheduler.core.hashing import BlockHasher

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("hash_form", ["int", "bytes"])
def test_subscriber_rebuilds_the_cached_hashes_of_a_real_scheduler(hash_form, tmp_path):
    pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    rng = random.Random(5)
    prefix = [rng.randrange(2, 512) for _ in range(40)]
    workload = [Generate(f"e{i}", prefix + [rng.randrange(2, 512) for _ in range(rng.randrange(1, 30))], rng.randrange(2, 30),
                         ignore_eos=True) for i in range(12)]
    form_flags = [] if hash_form == "int" else ["--no-kv-events-int-block-hashes"]
    with Cluster(["--kv-events-endpoint", pub, "--kv-events-replay-endpoint", replay, "--dev-mode", *form_flags], log_dir=tmp_path) as c:
        sub = KVEventSubscriber(pub, replay)
        try:
            results = c.generate(workload)
            m = c.metrics()
            # Every full block of what each request computed (all but its last token) is cached.
            hasher = BlockHasher(16)
            expected = set()
            for g in workload:
                tokens = g.prompt_token_ids + results[g.request_id].token_ids
                hashes = hasher.block_hashes(tokens[:-1])
                # By default as vLLM 0.33 sends them: the low 64 bits, as ints.
                expected |= {int_block_hash(h) for h in hashes} if hash_form == "int" else set(hashes)
            assert m["kvpool_cached_block_hashes"] == len(expected)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and sub.cached_hashes != expected:
                sub.poll(0.2)
            assert sub.cached_hashes == expected
            assert sub.num_lost == 0

            req = urllib.request.Request(f"http://127.0.0.1:{c.http_port}/reset_prefix_cache", method="POST")
            with urllib.request.urlopen(req, timeout=5) as r:
                assert r.status == 200
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and sub.cached_hashes:
                sub.poll(0.2)
            assert sub.cached_hashes == set()
        finally:
            sub.close()
