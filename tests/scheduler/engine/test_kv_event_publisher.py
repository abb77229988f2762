"""The KV event publisher on its own: endpoints it accepts, what each event carries
on the wire, batch numbering and replay exactly as vLLM's, and BlockRemoved only
when the last duplicate of a hash goes."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq
import zmq.asyncio

from protocol import kv_events as wire
from scheduler.core.hashing import BlockHasher
from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventRecorder
from scheduler.engine.kv_event_publisher import (
    KVEventPublisher,
    check_local_endpoint,
    make_kv_event_sink,
    to_wire_event,
)
from scheduler.sched.request import Request

VOCAB = 64
EOS = 1
BLOCK_SIZE = 4
LOCAL = "tcp://127.0.0.1:*"


def pool_hashes(kv: KVCacheManager) -> set[bytes]:
    return set(kv.block_pool.cached_block_hash_to_block.keys())


@pytest.mark.parametrize(
    "endpoint",
    ["tcp://0.0.0.0:5557", "tcp://*:5557", "tcp://10.1.2.3:5557", "tcp://example.com:5557", "tcp://eth0:5557",
     "tcp://127.0.0.1", "127.0.0.1:5557", "udp://127.0.0.1:5557", "ipc://", "epgm://127.0.0.1:5557"],
)
def test_non_loopback_endpoints_are_refused(endpoint):
    with pytest.raises(ValueError, match="kv-events"):
        KVEventPublisher(None, endpoint)
    with pytest.raises(ValueError, match="kv-events-replay-endpoint"):
        KVEventPublisher(None, "inproc://kv-ok", endpoint)


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:5557", "tcp://localhost:5557", "tcp://[::1]:5557",
                                      "tcp://127.0.0.1:*", "ipc:///tmp/kv.sock", "inproc://kv"])
def test_loopback_ipc_and_inproc_are_allowed(endpoint):
    check_local_endpoint(endpoint)


def test_to_wire_event_fills_what_vllm_fills():
    h = [bytes([i]) * 32 for i in range(3)]
    stored = to_wire_event(BlockStored(h[1:], h[0], list(range(8)), 4), int_block_hashes=False)
    assert stored == wire.BlockStored(
        block_hashes=h[1:], parent_block_hash=h[0], token_ids=list(range(8)), block_size=4, lora_id=None,
        medium="GPU", lora_name=None, group_idx=0, kv_cache_spec_kind="full_attention",
    )
    assert to_wire_event(BlockStored(h[:1], None, None, 4)).token_ids == []
    assert to_wire_event(BlockRemoved([h[2]]), int_block_hashes=False) == wire.BlockRemoved(block_hashes=[h[2]], medium="GPU", group_idx=0)
    assert to_wire_event(AllBlocksCleared()) == wire.AllBlocksCleared()
    # The default, as vLLM 0.33's: the low 64 bits as an int (h[1] = 0x0101...01).
    as_int = to_wire_event(BlockStored([h[1]], h[0], [1, 2, 3, 4], 4))
    assert as_int.block_hashes == [0x0101010101010101] and as_int.parent_block_hash == 0
    assert to_wire_event(BlockRemoved([h[2]])).block_hashes == [0x0202020202020202]


def test_a_hybrid_groups_events_carry_its_index_kind_and_window_as_vllms():
    h = [bytes([i]) * 32 for i in range(3)]
    stored = to_wire_event(BlockStored(h[1:], h[0], list(range(8)), 4, group_idx=2, sliding_window=512), int_block_hashes=False)
    assert stored == wire.BlockStored(
        block_hashes=h[1:], parent_block_hash=h[0], token_ids=list(range(8)), block_size=4, lora_id=None,
        medium="GPU", lora_name=None, group_idx=2, kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=512,
    )
    full = to_wire_event(BlockStored(h[1:], None, [], 4, group_idx=5), int_block_hashes=False)
    assert (full.group_idx, full.kv_cache_spec_kind, full.kv_cache_spec_sliding_window) == (5, "full_attention", None)
    removed = to_wire_event(BlockRemoved([h[2]], group_idx=3), int_block_hashes=False)
    assert removed == wire.BlockRemoved(block_hashes=[h[2]], medium="GPU", group_idx=3)


def test_host_tier_events_go_out_as_vllms_offloading_connector_sends_them():
    h = [bytes([i]) * 32 for i in range(3)]
    stored = to_wire_event(BlockStored(h[1:], None, [], 4, "CPU"), int_block_hashes=False)
    assert stored == wire.BlockStored(
        block_hashes=h[1:], parent_block_hash=None, token_ids=[], block_size=4, lora_id=None, medium="CPU", lora_name=None
    )
    assert stored.group_idx is None and stored.kv_cache_spec_kind is None
    removed = to_wire_event(BlockRemoved([h[2]], "CPU"))
    assert removed == wire.BlockRemoved(block_hashes=[0x0202020202020202], medium="CPU")


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
        assert batch.data_parallel_rank == 0 and batch.events[0].block_hashes == [0x0202020202020202]
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
    assert recorder.take_events()[0].block_hashes == [h0, h1]
    assert kv.block_pool.cached_block_hash_to_block.num_blocks(h0) == 2
    kv.free(a)
    kv.free(b)
    # head -> b2 -> a2 -> a1(h1) -> a0(h0) -> b1(h1) -> b0(h0) -> tail
    c = Request("c", [60] * 16, 4, seq_id=2, block_hasher=hasher)
    kv.allocate_slots(c, 16)  # takes b2, a2, a1, a0: a's hashes go, b still holds them
    assert [type(e) for e in recorder.events] == [BlockStored]
    recorder.take_events()
    assert {h0, h1} <= pool_hashes(kv)
    kv.free(c)
    # head -> b1(h1) -> b0(h0) -> c3 -> c2 -> c1 -> c0 -> tail
    d = Request("d", [61] * 5, 4, seq_id=3, block_hasher=hasher)
    kv.allocate_slots(d, 5)  # takes b1, b0: the last blocks holding h1, h0
    events = recorder.take_events()
    assert [e.block_hashes for e in events if isinstance(e, BlockRemoved)] == [[h1], [h0]]
    assert not {h0, h1} & pool_hashes(kv)
    kv.check_invariants()


# --- a random workload through the scheduler -------------------------------------------


@pytest.mark.parametrize(
    "env, argv, expected",
    [
        (None, [], True),  # vLLM 0.33's default: ints
        ("1", [], True),
        ("0", [], False),
        ("0", ["--kv-events-int-block-hashes"], True),  # the flag wins over the variable
        ("1", ["--no-kv-events-int-block-hashes"], False),
    ],
)
def test_hash_form_follows_vllms_variable_and_the_flag(env, argv, expected, monkeypatch):
    from scheduler.engine.args import config_from_args

    if env is None:
        monkeypatch.delenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", raising=False)
    else:
        monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", env)
    assert config_from_args(argv).kv_events_int_block_hashes is expected


def test_a_bad_hash_form_variable_is_refused_naming_it(monkeypatch, capsys):
    from scheduler.engine.args import config_from_args

    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "yes")
    with pytest.raises(SystemExit) as e:
        config_from_args([])
    assert e.value.code == 2 and "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES='yes'" in capsys.readouterr().err


def test_the_bytes_form_goes_out_whole():
    ctx = zmq.Context()
    pub = KVEventPublisher(ctx, LOCAL, LOCAL, int_block_hashes=False)
    try:
        pub.publish([BlockStored([b"\x07" * 32], None, [1] * 4, 4)])
        batch = wire.batch_codec().decode(replay_frames(pub.replay_endpoint, 0, ctx)[0][3])
        assert batch.events[0].block_hashes == [b"\x07" * 32]
    finally:
        pub.close()
        ctx.term()
