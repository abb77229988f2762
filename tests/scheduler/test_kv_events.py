"""KV events end to end: the pool's changes, published over a real ZMQ PUB socket
with a replay socket, rebuild the pool's set of cached hashes in a subscriber,
across a reset, a subscriber restart and gaps filled by replay.
"""

from __future__ import annotations

import random
import time

import msgspec
import pytest
import zmq
import zmq.asyncio
from kvtest.fake_worker import FakeWorker

from loadgen.kv_events import KVEventSubscriber
from protocol import kv_events as wire
from scheduler.hashing import BlockHasher
from scheduler.kv_cache_manager import KVCacheManager
from scheduler.kv_event_publisher import (
    KVEventPublisher,
    check_local_endpoint,
    make_kv_event_sink,
    to_wire_event,
)
from scheduler.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventRecorder
from scheduler.request import Request
from scheduler.scheduler import Scheduler

VOCAB = 64
EOS = 1
BLOCK_SIZE = 4
LOCAL = "tcp://127.0.0.1:*"


def pool_hashes(kv: KVCacheManager) -> set[bytes]:
    return set(kv.block_pool.cached_block_hash_to_block.keys())


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


@pytest.mark.parametrize(
    "endpoint",
    ["tcp://0.0.0.0:5557", "tcp://*:5557", "tcp://10.1.2.3:5557", "tcp://example.com:5557", "tcp://eth0:5557",
     "tcp://127.0.0.1", "127.0.0.1:5557", "udp://127.0.0.1:5557", "ipc://", "epgm://127.0.0.1:5557"],
)  # fmt: skip
def test_non_loopback_endpoints_are_refused(endpoint):
    with pytest.raises(ValueError, match="kv-events"):
        KVEventPublisher(None, endpoint)
    with pytest.raises(ValueError, match="kv-events-replay-endpoint"):
        KVEventPublisher(None, "inproc://kv-ok", endpoint)


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:5557", "tcp://localhost:5557", "tcp://[::1]:5557",
                                      "tcp://127.0.0.1:*", "ipc:///tmp/kv.sock", "inproc://kv"])  # fmt: skip
def test_loopback_ipc_and_inproc_are_allowed(endpoint):
    check_local_endpoint(endpoint)


def test_to_wire_event_fills_what_vllm_fills():
    h = [bytes([i]) * 32 for i in range(3)]
    stored = to_wire_event(BlockStored(h[1:], h[0], list(range(8)), 4))
    assert stored == wire.BlockStored(
        block_hashes=h[1:], parent_block_hash=h[0], token_ids=list(range(8)), block_size=4, lora_id=None,
        medium="GPU", lora_name=None, group_idx=0, kv_cache_spec_kind="full_attention",
    )  # fmt: skip
    assert to_wire_event(BlockStored(h[:1], None, None, 4)).token_ids == []
    assert to_wire_event(BlockRemoved([h[2]])) == wire.BlockRemoved(block_hashes=[h[2]], medium="GPU", group_idx=0)
    assert to_wire_event(AllBlocksCleared()) == wire.AllBlocksCleared()
    as_int = to_wire_event(BlockStored([h[1]], h[0], [1, 2, 3, 4], 4), int_block_hashes=True)
    assert as_int.block_hashes == [wire.int_block_hash(h[1])] and as_int.parent_block_hash == wire.int_block_hash(h[0])


def replay_frames(endpoint: str, start_seq: int, ctx: zmq.Context, timeout_s: float = 5.0) -> list[list[bytes]]:
    """A raw replay request, as vLLM's subscribers send it; every reply up to the end marker."""
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.connect(endpoint)
        sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        replies = []
        while True:
            assert sock.poll(int(timeout_s * 1000)), "no answer from the replay socket"
            frames = sock.recv_multipart()
            replies.append(frames)
            if frames[2] == b"\xff" * 8:
                return replies
    finally:
        sock.close(linger=0)


def test_batches_are_numbered_and_replayed_as_vllm_does():
    ctx = zmq.Context()
    pub = KVEventPublisher(ctx, LOCAL, LOCAL, topic="kv", buffer_steps=3)
    try:
        pub.publish([])  # an empty step sends nothing and takes no number
        assert pub.last_seq == -1
        for i in range(5):
            pub.publish([BlockStored([bytes([i]) * 32], None, [i] * 4, 4)])
        pub.publish([])
        assert pub.last_seq == 4
        # The buffer keeps the last 3 batches (2, 3, 4): [b"", topic, seq, payload] each,
        # then vLLM's end marker [b"", b"", -1, b""].
        replies = replay_frames(pub.replay_endpoint, 0, ctx)
        assert [f[:3] for f in replies[:-1]] == [[b"", b"kv", s.to_bytes(8, "big")] for s in (2, 3, 4)]
        assert replies[-1] == [b"", b"", b"\xff" * 8, b""]
        batch = wire.batch_codec().decode(replies[0][3])
        assert batch.data_parallel_rank == 0 and batch.events[0].block_hashes == [b"\x02" * 32]
        assert [f[2] for f in replay_frames(pub.replay_endpoint, 4, ctx)] == [(4).to_bytes(8, "big"), b"\xff" * 8]
        assert replay_frames(pub.replay_endpoint, 9, ctx) == [[b"", b"", b"\xff" * 8, b""]]
    finally:
        pub.close()
        ctx.term()


def test_publisher_on_an_asyncio_context_and_pub_frames():
    # The scheduler's loop owns a zmq.asyncio.Context: the publisher makes plain
    # sockets on it and never blocks the loop.
    actx = zmq.asyncio.Context()
    ctx = zmq.Context()
    pub = KVEventPublisher(actx, LOCAL, None, topic="kv")
    sub = ctx.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(pub.endpoint)
        deadline = time.monotonic() + 10
        # Slow joiner: publish until the subscription has reached the publisher.
        while not sub.poll(50):
            assert time.monotonic() < deadline
            pub.publish([AllBlocksCleared()])
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv" and len(seq) == 8 and int.from_bytes(seq, "big") <= pub.last_seq
        assert msgspec.msgpack.decode(payload)[1] == [{"type": "AllBlocksCleared"}]
    finally:
        sub.close(linger=0)
        pub.close()
        ctx.term()
        actx.term()
    with pytest.raises(RuntimeError):
        pub.publish([AllBlocksCleared()])


def test_make_kv_event_sink():
    assert make_kv_event_sink(None, None) == (None, None)
    with pytest.raises(ValueError, match="needs --kv-events-endpoint"):
        make_kv_event_sink(None, None, "inproc://replay")
    sink, pub = make_kv_event_sink(None, LOCAL, LOCAL, "kv")
    try:
        assert isinstance(sink, KVEventRecorder) and pub.topic == b"kv" and pub.replay_endpoint
    finally:
        pub.close()


# --- duplicates ---------------------------------------------------------------------


def test_block_removed_only_when_the_last_duplicate_goes():
    recorder = KVEventRecorder()
    kv = KVCacheManager(7, BLOCK_SIZE, 64, event_sink=recorder)
    hasher = BlockHasher(BLOCK_SIZE)
    prompt = list(range(2, 11))  # 9 tokens: 2 full blocks + 1 partial
    a = Request("a", prompt, 4, seq_id=0, block_hasher=hasher)
    b = Request("b", list(prompt), 4, seq_id=1, block_hasher=hasher)
    h0, h1 = a.block_hashes[:2]
    # Admitted together: both looked up before either is cached, so both miss and
    # each fills its own blocks with the same hashes.
    assert kv.get_computed_blocks(a)[1] == 0 and kv.get_computed_blocks(b)[1] == 0
    kv.allocate_slots(a, 9)
    kv.allocate_slots(b, 9)
    assert [type(e) for e in recorder.events] == [BlockStored]  # b's duplicates: no new hash
    assert recorder.take()[0].block_hashes == [h0, h1]
    assert kv.block_pool.cached_block_hash_to_block.num_blocks(h0) == 2
    kv.free(a)
    kv.free(b)
    # head -> b2 -> a2 -> a1(h1) -> a0(h0) -> b1(h1) -> b0(h0) -> tail
    c = Request("c", [60] * 16, 4, seq_id=2, block_hasher=hasher)
    kv.allocate_slots(c, 16)  # takes b2, a2, a1, a0: a's hashes go, b still holds them
    assert [type(e) for e in recorder.events] == [BlockStored]
    recorder.take()
    assert {h0, h1} <= pool_hashes(kv)
    kv.free(c)
    # head -> b1(h1) -> b0(h0) -> c3 -> c2 -> c1 -> c0 -> tail
    d = Request("d", [61] * 5, 4, seq_id=3, block_hasher=hasher)
    kv.allocate_slots(d, 5)  # takes b1, b0: the last blocks holding h1, h0
    events = recorder.take()
    assert [e.block_hashes for e in events if isinstance(e, BlockRemoved)] == [[h1], [h0]]
    assert not {h0, h1} & pool_hashes(kv)
    kv.check_invariants()


# --- a random workload through the scheduler -------------------------------------------


def make_workload(rng: random.Random, n: int, first_id: int) -> list[dict]:
    prefixes = [[rng.randrange(2, VOCAB) for _ in range(rng.randrange(1, 4) * BLOCK_SIZE)] for _ in range(3)]
    reqs = []
    for i in range(n):
        prompt = (rng.choice(prefixes) if rng.random() < 0.7 else []) + [rng.randrange(2, VOCAB) for _ in range(rng.randrange(1, 20))]
        reqs.append(dict(request_id=f"r{first_id + i}", prompt=prompt, max_tokens=rng.randrange(1, 24),
                         arrive_step=rng.randrange(0, n // 2 + 1)))  # fmt: skip
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
                                               eos_token_id=EOS, block_hasher=self.hasher))  # fmt: skip
                self.num_seqs += 1
            out = self.sched.schedule()
            if out is not None:
                self.sched.update_from_output(self.worker.execute(out.plan))
            self.publisher.publish(self.recorder.take())
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
        pub.publish(engine.recorder.take())
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
        assert sub.cached_hashes == set(hashes[3:])
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
                                 curve_server_key=server_public)  # fmt: skip
        bad = KVEventSubscriber(pub.endpoint, pub.replay_endpoint, replay_timeout_s=0.5,
                                curve_secret_key=str(other / "stranger.key_secret"), curve_server_key=server_public)  # fmt: skip
        subs += [good, bad]
        assert good.sync() == 1 and good.cached_hashes == {b"\x01" * 32}
        assert bad.sync() == 0 and bad.cached_hashes == set()
        with pytest.raises(ValueError, match="together"):
            KVEventSubscriber(pub.endpoint, curve_secret_key=server_secret)
    finally:
        for sub in subs:
            sub.close()
        pub.close()
        auth.stop()
        ctx.term()
