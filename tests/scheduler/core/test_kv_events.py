"""KV events end to end: the pool's changes, published over a real ZMQ PUB socket
with a replay socket, rebuild the pool's set of cached hashes in a subscriber,
across a reset, a subscriber restart and gaps filled by replay.
"""

from __future__ import annotations

import random
import time

import pytest
from kvtest.fake_worker import FakeWorker

from loadgen.kv_events import KVEventSubscriber
from protocol import kv_events as wire
from protocol.kv_events import MEDIUM_CPU
from scheduler.core.hashing import BlockHasher
from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventRecorder,
)
from scheduler.engine.kv_event_publisher import (
    KVEventPublisher,
    check_local_endpoint,
)
from scheduler.sched.request import Request
from scheduler.sched.scheduler import Scheduler

VOCAB = 64
EOS = 1
BLOCK_SIZE = 4
LOCAL = "tcp://127.0.0.1:*"


def pool_hashes(kv: KVCacheManager) -> set[int]:
    """The pool's hashes as the publisher sends them by default (vLLM's int form)."""
    return {wire.int_block_hash(h) for h in kv.block_pool.cached_block_hash_to_block.keys()}


class Seqs:
    """on_batch callback: the sequence numbers a subscriber applied, and event counts."""

    def __init__(self):
        self.seqs: list[int] = []
        self.counts = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}

    def __call__(self, seq: int, batch: wire.KVEventBatch) -> None:
        self.seqs.append(seq)
        for e in batch.events:
            self.counts[type(e).__name__] += 1

    def assert_consecutive_from(self, first: int) -> None:
        assert self.seqs == list(range(first, first + len(self.seqs)))


def catch_up(sub: KVEventSubscriber, pub: KVEventPublisher, on_batch, timeout_s: float = 10.0) -> None:
    """Poll until ``sub`` has applied everything ``pub`` published. A SUB socket
    misses what was sent before its subscription reached the publisher (the
    "slow joiner"); with nothing newer to reveal the gap, ask the replay socket."""
    deadline = time.monotonic() + timeout_s
    while sub.last_seq < pub.last_seq:
        assert time.monotonic() < deadline, f"subscriber stuck at seq {sub.last_seq}, published {pub.last_seq}"
        if not sub.poll(0.2, on_batch):
            sub.replay(on_batch)


# --- the publisher on its own -------------------------------------------------------


def make_workload(rng: random.Random, n: int, first_id: int) -> list[dict]:
    prefixes = [[rng.randrange(2, VOCAB) for _ in range(rng.randrange(1, 4) * BLOCK_SIZE)] for _ in range(3)]
    reqs = []
    for i in range(n):
        prompt = (rng.choice(prefixes) if rng.random() < 0.7 else []) + [rng.randrange(2, VOCAB) for _ in range(rng.randrange(1, 20))]
        reqs.append(dict(request_id=f"r{first_id + i}", prompt=prompt, max_tokens=rng.randrange(1, 24),
                         arrive_step=rng.randrange(0, n // 2 + 1)))
    return reqs


class Engine:
    """The step loop as the scheduler process runs it, publishing after each step."""

    def __init__(self, num_blocks: int, publisher: KVEventPublisher):
        self.recorder = KVEventRecorder()
        self.kv = KVCacheManager(num_blocks, BLOCK_SIZE, 256, event_sink=self.recorder)
        self.sched = Scheduler(self.kv, 8, 64, 256)
        self.worker = FakeWorker(num_blocks, BLOCK_SIZE, VOCAB)
        self.hasher = BlockHasher(BLOCK_SIZE)
        self.publisher = publisher
        self.num_seqs = 0

    def run(self, workload: list[dict], every: int = 0, at_step=None) -> None:
        """Run ``workload`` to the end; ``at_step(step)`` every ``every`` steps."""
        pending = sorted(workload, key=lambda w: w["arrive_step"])
        for step in range(10_000):
            while pending and pending[0]["arrive_step"] <= step:
                w = pending.pop(0)
                self.sched.add_request(Request(w["request_id"], w["prompt"], w["max_tokens"], seq_id=self.num_seqs,
                                               eos_token_id=EOS, block_hasher=self.hasher))
                self.num_seqs += 1
            out = self.sched.schedule()
            if out is not None:
                self.sched.update_from_output(self.worker.execute(out.plan))
            self.publisher.publish(self.recorder.take_events())
            if every and at_step is not None and step % every == every - 1:
                at_step(step)
            if not pending and not self.sched.has_unfinished_requests():
                return
        raise AssertionError("workload did not finish")


def test_subscriber_rebuilds_the_pools_hashes_across_reset_and_restart():
    rng = random.Random(7)
    pub = KVEventPublisher(None, LOCAL, LOCAL, topic="kv-events")
    subs: list[KVEventSubscriber] = []

    def subscriber() -> KVEventSubscriber:
        subs.append(KVEventSubscriber(pub.endpoint, pub.replay_endpoint, "kv-events"))
        return subs[-1]

    try:
        # A small pool: preemptions and evictions, so BlockRemoved too.
        engine = Engine(24, pub)
        sub1, seen1 = subscriber(), Seqs()
        sub1.sync(seen1)

        def check(step):
            catch_up(sub1, pub, seen1)
            assert sub1.cached_hashes == pool_hashes(engine.kv), f"step {step}"

        engine.run(make_workload(rng, 40, 0), every=7, at_step=check)
        check("end of workload 1")
        assert seen1.counts["BlockStored"] and seen1.counts["BlockRemoved"]
        assert sub1.num_batches > sub1.num_replayed_batches  # the live path was used

        assert engine.kv.reset_prefix_cache()
        pub.publish(engine.recorder.take_events())
        check("after reset")
        assert sub1.cached_hashes == set() and seen1.counts["AllBlocksCleared"] == 1

        # Stop the subscriber mid-way through the next workload; the workload goes on.
        stopped = {}

        def stop_once(step):
            if not stopped:
                check(step)
                stopped.update(seq=sub1.last_seq, hashes=set(sub1.cached_hashes))
                sub1.close()
                subs.remove(sub1)

        engine.run(make_workload(rng, 40, 100), every=20, at_step=stop_once)
        assert stopped and pub.last_seq > stopped["seq"]
        seen1.assert_consecutive_from(0)

        # A new subscriber from nothing: replays from seq 0 and catches up.
        sub2, seen2 = subscriber(), Seqs()
        catch_up(sub2, pub, seen2)
        assert sub2.cached_hashes == pool_hashes(engine.kv)
        assert seen2.seqs[0] == 0 and seen2.counts["AllBlocksCleared"] == 1
        assert sub2.num_replays >= 1 and sub2.num_lost == 0

        # A restarted subscriber that kept its state resumes where it left off.
        sub3, seen3 = subscriber(), Seqs()
        sub3.cached_hashes, sub3.last_seq = stopped["hashes"], stopped["seq"]
        catch_up(sub3, pub, seen3)
        assert sub3.cached_hashes == pool_hashes(engine.kv)
        assert seen3.seqs[0] == stopped["seq"] + 1

        # Both stay in step with more work, live.
        engine.run(make_workload(rng, 20, 200), every=5, at_step=lambda step: None)
        for sub, seen in ((sub2, seen2), (sub3, seen3)):
            catch_up(sub, pub, seen)
            assert sub.cached_hashes == pool_hashes(engine.kv)
        seen2.assert_consecutive_from(0)
        seen3.assert_consecutive_from(stopped["seq"] + 1)
        engine.kv.check_invariants()
    finally:
        for sub in subs:
            sub.close()
        pub.close()


def test_a_gap_older_than_the_buffer_is_counted_as_lost():
    pub = KVEventPublisher(None, LOCAL, LOCAL, buffer_steps=2)
    sub = KVEventSubscriber(pub.endpoint, pub.replay_endpoint)
    try:
        hashes = [bytes([i]) * 32 for i in range(5)]
        for h in hashes:
            pub.publish([BlockStored([h], None, [1] * 4, 4)])
        seen = Seqs()
        catch_up(sub, pub, seen)
        assert seen.seqs == [3, 4] and sub.num_lost == 3
        assert sub.cached_hashes == {0x0303030303030303, 0x0404040404040404}
    finally:
        sub.close()
        pub.close()


def test_the_cli_prints_events_and_the_count(capsys):
    from loadgen.kv_events import main

    pub = KVEventPublisher(None, LOCAL, LOCAL, topic="kv")
    try:
        h = [bytes([i]) * 32 for i in range(3)]
        pub.publish([BlockStored(h[:2], None, list(range(8)), 4)])
        pub.publish([BlockRemoved([h[0]]), BlockStored(h[2:], h[1], [1, 2, 3, 4], 4)])
        argv = ["--endpoint", pub.endpoint, "--replay-endpoint", pub.replay_endpoint, "--topic", "kv", "--duration", "0.3"]
        assert main(argv + ["--events"]) == 0
        out = capsys.readouterr().out
        assert "seq 0 " in out and "seq 1 " in out and "BlockRemoved [0000000000000000]" in out
        assert main(argv) == 0
        assert "seq 1: 2 cached block hashes (lost 0)" in capsys.readouterr().out
    finally:
        pub.close()


def test_curve_admits_only_authorized_subscribers(tmp_path):
    import zmq.auth
    from zmq.auth.thread import ThreadAuthenticator

    allowed, other = tmp_path / "allowed", tmp_path / "other"
    allowed.mkdir()
    other.mkdir()
    zmq.auth.create_certificates(tmp_path, "scheduler")
    zmq.auth.create_certificates(allowed, "router")
    zmq.auth.create_certificates(other, "stranger")
    server_secret, server_public = str(tmp_path / "scheduler.key_secret"), str(tmp_path / "scheduler.key")
    check_local_endpoint("tcp://0.0.0.0:5557", allow_remote=True)
    with pytest.raises(ValueError, match="context"):
        KVEventPublisher(None, LOCAL, curve_secret_key=server_secret)
    ctx = zmq.Context()
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=str(allowed))
    pub = KVEventPublisher(ctx, LOCAL, LOCAL, curve_secret_key=server_secret)
    subs = []
    try:
        pub.publish([BlockStored([b"\x01" * 32], None, [1] * 4, 4)])
        good = KVEventSubscriber(pub.endpoint, pub.replay_endpoint, curve_secret_key=str(allowed / "router.key_secret"),
                                 curve_server_key=server_public)
        bad = KVEventSubscriber(pub.endpoint, pub.replay_endpoint, replay_timeout_s=0.5,
                                curve_secret_key=str(other / "stranger.key_secret"), curve_server_key=server_public)
        subs += [good, bad]
        assert good.sync() == 1 and good.cached_hashes == {0x0101010101010101}
        assert bad.sync() == 0 and bad.cached_hashes == set()
        with pytest.raises(ValueError, match="together"):
            KVEventSubscriber(pub.endpoint, curve_secret_key=server_secret)
    finally:
        for sub in subs:
            sub.close()
        pub.close()
        auth.stop()
        ctx.term()


def test_the_subscriber_keeps_the_host_tier_apart_from_the_device_pool():
    # One hash cached in both tiers: losing its host copy leaves the device's.
    pub = KVEventPublisher(None, LOCAL, LOCAL)
    sub = KVEventSubscriber(pub.endpoint, pub.replay_endpoint)
    try:
        a, b = bytes([1]) * 32, bytes([2]) * 32
        pub.publish([BlockStored([a, b], None, [1] * 8, 4)])
        pub.publish([BlockStored([b], None, None, 4, MEDIUM_CPU), BlockStored([a], None, None, 4, MEDIUM_CPU)])
        pub.publish([BlockRemoved([b], MEDIUM_CPU), BlockRemoved([a])])
        catch_up(sub, pub, Seqs())
        int_a, int_b = 0x0101010101010101, 0x0202020202020202
        assert sub.cached_hashes == {int_b}
        assert sub.host_hashes == {int_a}
        pub.publish([AllBlocksCleared()])
        catch_up(sub, pub, Seqs())
        assert sub.cached_hashes == set() and sub.host_hashes == set()
    finally:
        sub.close()
        pub.close()
