"""P/D disaggregation's worker side (worker/transfer/) over real ZMQ sockets on free loopback
ports and real KV tensors: a KVServer lends blocks, a KVPuller reads them into other block
ids bit for bit; every refusal (unknown after a bounded wait, taken back, another identity,
blocks not lent, a malformed frame, the wrong size) and a server gone (a timeout) writes
nothing and reports 0; a lend that comes just after the read is served; a read is reported
sent once; `open_kv_transfer` opens the parts of the role (a hybrid model's too). Every thread is stopped in teardown, every wait bounded."""

from __future__ import annotations

import time
from types import SimpleNamespace

import msgspec
import pytest
import torch
import zmq

from protocol.kv_cache_spec import KVCacheGroupSpec
from protocol.kv_pull_wire import PullReply, PullRequest
from protocol.kv_transfer_config import parse_kv_transfer_config
from worker.kv.kv_block_bytes import block_bytes, gather_blocks, kv_block_identity, write_blocks
from worker.transfer.kv_puller import KVPuller, Pull
from worker.transfer.kv_server import KVServer
from worker.transfer.kv_transfer import open_kv_transfer

IDENTITY = "ab" * 16
LAYERS, NUM_BLOCKS, BS, KVH, HD = 3, 12, 4, 2, 8
BOUND_S = 10.0  # every drain is bounded
SHORT_WAIT_S = 0.3  # a server's wait for a lend, a puller's read timeout, where a test waits them out


def kv_caches(seed: int, dtype: torch.dtype = torch.bfloat16, head_dim: int = HD) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # One per layer: (2, num_blocks, block_size, kv_heads, head_dim), K then V.
    return [torch.randn(2, NUM_BLOCKS, BS, KVH, head_dim, generator=g).to(dtype) for _ in range(LAYERS)]


def bits(kv: torch.Tensor, block_id: int) -> torch.Tensor:
    """One block of one layer, K and V, as raw bytes."""
    return kv[:, block_id].contiguous().view(torch.uint8)


def same_blocks(src: list[torch.Tensor], src_ids: list[int], dst: list[torch.Tensor], dst_ids: list[int]) -> bool:
    return all(torch.equal(bits(s, a), bits(d, b)) for s, d in zip(src, dst, strict=True) for a, b in zip(src_ids, dst_ids, strict=True))


@pytest.fixture
def make():
    """Servers and pullers, each closed in teardown (a failing test included)."""
    made: list[KVServer | KVPuller] = []

    class Make:
        @staticmethod
        def server(caches=None, lend_wait_s: float = SHORT_WAIT_S, identity: str = IDENTITY) -> KVServer:
            made.append(KVServer(kv_caches(1) if caches is None else caches, identity, "127.0.0.1", 0, lend_wait_s=lend_wait_s))
            return made[-1]

        @staticmethod
        def puller(caches=None, read_timeout: float = BOUND_S, identity: str = IDENTITY) -> KVPuller:
            made.append(KVPuller(kv_caches(2) if caches is None else caches, identity, read_timeout))
            return made[-1]

    yield Make
    for part in made:
        part.close()
        assert not part._thread.is_alive()


def pull(puller: KVPuller, server_address: str, request_id: str, remote: list[int], local: list[int], pull_id: int = 1) -> dict[int, int]:
    """One pull of one KV-cache group's blocks, waited for (bounded); the puller's news."""
    puller.submit([Pull(pull_id, server_address, request_id, [remote], local)])
    assert puller.has_pending
    assert puller.drain(BOUND_S)
    assert not puller.has_pending
    return puller.take_pulled()


def test_the_bytes_of_blocks_round_trip_through_a_buffer():
    src, dst = kv_caches(1, torch.float8_e4m3fn), kv_caches(2, torch.float8_e4m3fn)
    raw = gather_blocks(src, [4, 1])  # (2, block_bytes)
    assert raw.shape == (2, block_bytes(src)) == (2, LAYERS * 2 * BS * KVH * HD)
    write_blocks(dst, [9, 3], raw.numpy().tobytes())  # a read-only buffer too
    assert same_blocks(src, [4, 1], dst, [9, 3])
    with pytest.raises(ValueError, match="bytes for 1 blocks"):
        write_blocks(dst, [5], raw.numpy())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_pulled_blocks_equal_the_lent_ones_bit_for_bit(make, dtype):
    src, dst = kv_caches(1, dtype), kv_caches(2, dtype)
    server, puller = make.server(src), make.puller(dst)
    before = [t.clone() for t in dst]
    server.lend("req-1", [[3, 5, 7]])
    assert pull(puller, server.address, "req-1", [3, 5, 7], [8, 2, 10], pull_id=41) == {41: 3}
    assert same_blocks(src, [3, 5, 7], dst, [8, 2, 10])
    others = [b for b in range(NUM_BLOCKS) if b not in (8, 2, 10)]
    assert same_blocks(before, others, dst, others)  # nothing else written
    assert server.take_sent() == ["req-1"] and server.take_sent() == []  # reported once
    assert puller.take_pulled() == {}
    n = block_bytes(src)
    assert (puller.counters.pulled_blocks, puller.counters.pulled_bytes) == (3, 3 * n)
    assert (server.counters.served_blocks, server.counters.served_bytes) == (3, 3 * n)
    # Read once: the lend is gone.
    assert pull(puller, server.address, "req-1", [3], [1], pull_id=42) == {42: 0}
    assert server.counters.refusals == {"unknown": 1} and puller.counters.failures == {"unknown": 1}


def test_a_pull_of_some_of_the_lent_blocks_is_served(make):
    server, puller = make.server(), make.puller()
    server.lend("req-1", [[3, 5, 7]])
    assert pull(puller, server.address, "req-1", [5, 7], [1, 2]) == {1: 2}
    assert same_blocks(server.kv_caches, [5, 7], puller.kv_caches, [1, 2])
    assert server.take_sent() == ["req-1"]


def test_a_read_of_a_request_never_lent_is_refused_after_the_bounded_wait(make):
    server, puller = make.server(lend_wait_s=SHORT_WAIT_S), make.puller()
    before = [t.clone() for t in puller.kv_caches]
    t0 = time.monotonic()
    assert pull(puller, server.address, "nobody", [3], [4]) == {1: 0}
    assert SHORT_WAIT_S <= time.monotonic() - t0 < BOUND_S
    assert all(torch.equal(a, b) for a, b in zip(before, puller.kv_caches, strict=True))
    assert server.counters.refusals == {"unknown": 1} and server.take_sent() == []


def test_a_lend_that_comes_just_after_the_read_is_served(make):
    server, puller = make.server(lend_wait_s=BOUND_S), make.puller()
    puller.submit([Pull(7, server.address, "late", [[2, 6]], [9, 11])])
    time.sleep(0.2)  # the read is parked on the server by now
    assert puller.has_pending
    server.lend("late", [[2, 6]])
    assert puller.drain(BOUND_S)
    assert puller.take_pulled() == {7: 2}
    assert same_blocks(server.kv_caches, [2, 6], puller.kv_caches, [9, 11])
    assert server.take_sent() == ["late"]


def test_a_lend_taken_back_is_refused(make):
    server, puller = make.server(), make.puller()
    server.lend("req-1", [[3]])
    server.lend("req-2", [[4]])
    server.unlend(["req-1", "never-lent"])
    assert pull(puller, server.address, "req-1", [3], [5]) == {1: 0}
    assert pull(puller, server.address, "req-2", [4], [5], pull_id=2) == {2: 1}
    assert server.take_sent() == ["req-2"]


def test_another_identity_is_refused_and_the_lend_kept(make):
    server = make.server()
    stranger, reader = make.puller(identity="cd" * 16), make.puller()
    server.lend("req-1", [[3]])
    assert pull(stranger, server.address, "req-1", [3], [5]) == {1: 0}
    assert stranger.counters.failures == {"identity": 1} and server.counters.refusals == {"identity": 1}
    assert pull(reader, server.address, "req-1", [3], [5]) == {1: 1}


def test_blocks_not_lent_are_refused_and_the_lend_kept(make):
    server, puller = make.server(), make.puller()
    server.lend("req-1", [[3, 5]])
    assert pull(puller, server.address, "req-1", [3, 6], [1, 2]) == {1: 0}
    assert server.counters.refusals == {"blocks": 1} and server.take_sent() == []
    assert pull(puller, server.address, "req-1", [3, 5], [1, 2], pull_id=2) == {2: 2}


@pytest.mark.parametrize("asked", [[5, 3], [3, 7], [5, 5], [3, 3, 5]])
def test_lent_blocks_out_of_order_or_twice_are_refused(make, asked):
    # Each block lands at its position in the reader's table: any list but a run of the lent
    # ones, in order, would put one block's KV where another's belongs.
    server, puller = make.server(), make.puller()
    server.lend("req-1", [[3, 5, 7]])
    assert pull(puller, server.address, "req-1", asked, list(range(1, len(asked) + 1))) == {1: 0}
    assert server.counters.refusals == {"blocks": 1}


def test_a_reader_of_another_block_size_writes_nothing(make):
    server = make.server()
    puller = make.puller(kv_caches(2, head_dim=HD * 2))  # the same identity claimed, other bytes per block
    before = [t.clone() for t in puller.kv_caches]
    server.lend("req-1", [[3]])
    assert pull(puller, server.address, "req-1", [3], [5]) == {1: 0}
    assert puller.counters.failures == {"size": 1}
    assert all(torch.equal(a, b) for a, b in zip(before, puller.kv_caches, strict=True))


def test_a_server_gone_times_out_within_read_timeout(make):
    server = make.server()
    address = server.address
    server.close()
    puller = make.puller(read_timeout=SHORT_WAIT_S)
    t0 = time.monotonic()
    assert pull(puller, address, "req-1", [3], [5]) == {1: 0}
    assert SHORT_WAIT_S <= time.monotonic() - t0 < SHORT_WAIT_S + 2.0
    assert puller.counters.failures == {"timeout": 1}
    # A bad address is a failure of its own, not a crash of the thread.
    assert pull(puller, "no-port", "req-1", [3], [5], pull_id=2) == {2: 0}
    assert puller.counters.failures == {"timeout": 1, "address": 1}


def test_malformed_frames_are_refused_and_the_server_goes_on(make):
    server = make.server()
    server.lend("req-1", [[3]])
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{server.address}")
        decoder = msgspec.msgpack.Decoder(PullReply)
        good = msgspec.msgpack.encode(PullRequest("req-1", [[3]], IDENTITY))
        for frames in ([b"garbage"], [b"\x93\x01\x02"], [good, b"more"]):
            sock.send_multipart(frames)
            assert sock.poll(BOUND_S * 1000)
            reply = decoder.decode(sock.recv_multipart()[0])
            assert (reply.ok, reply.error) == (False, "malformed"), reply
        sock.send(good)
        assert sock.poll(BOUND_S * 1000)
        head, payload = sock.recv_multipart()
        assert decoder.decode(head) == PullReply(True, 1, block_bytes(server.kv_caches))
        assert len(payload) == block_bytes(server.kv_caches)
    finally:
        sock.close()
        ctx.term()
    assert server.counters.refusals == {"malformed": 3} and server.take_sent() == ["req-1"]


def test_open_kv_transfer_opens_the_parts_of_the_role_for_one_group_or_hybrid_groups():
    config = parse_kv_transfer_config('{"kv_connector": "KVPoolConnector", "kv_role": "kv_both"}')
    serving = SimpleNamespace(kv_cache_groups=[], config=SimpleNamespace(architecture="LlamaForCausalLM"), identity="m" * 16)
    assert open_kv_transfer(None, serving, kv_caches(1), BS) is None
    for groups in ([], [KVCacheGroupSpec([0, 2], 0), KVCacheGroupSpec([1], 8)]):
        serving.kv_cache_groups = groups
        transfer = open_kv_transfer(config, serving, kv_caches(1), BS)
        try:
            assert transfer.server is not None and transfer.puller is not None
            assert transfer.identity == kv_block_identity(serving, kv_caches(1), BS) and len(transfer.identity) == 32
        finally:
            transfer.close()
