"""The ZMQ transport of bench/pd_transfer_bench.py: a prefill worker's ROUTER in a child
process serves N blocks; this process's DEALER reads them into its own KV tensors."""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

import msgspec
import torch
import zmq

from bench.pd_transfer_parts import (
    POLL_MS,
    READ_TIMEOUT_S,
    START_TIMEOUT_S,
    KVLayout,
    block_ids,
    figure,
    gather_blocks,
    make_kv_cache,
    median_s,
    orphaned,
    same_blocks,
    scatter_blocks,
    stop_process,
)


class ReadBlocks(msgspec.Struct, tag="read", array_like=True):
    """Send these blocks; ``gather=False``: send the copy gathered for the same ids before."""

    block_ids: list[int]
    gather: bool = True


class Stop(msgspec.Struct, tag="stop", array_like=True):
    pass


class BlocksHeader(msgspec.Struct, array_like=True):
    """The reply's first frame; one frame per layer follows, (2, n, bs, h, d) bf16 bytes."""

    gather_s: float


def serve_blocks_zmq(layout: KVLayout, seed: int, parent_pid: int, conn: Connection) -> None:
    """The prefill worker: a ROUTER on a free loopback port (sent back on ``conn``)
    answering ReadBlocks until Stop or until its parent is gone."""
    kv_cache = make_kv_cache(layout, seed)
    gathered: dict[tuple[int, ...], list[torch.Tensor]] = {}
    decoder = msgspec.msgpack.Decoder(ReadBlocks | Stop)
    encoder = msgspec.msgpack.Encoder()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind("tcp://127.0.0.1:0")
    conn.send(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    try:
        while not orphaned(parent_pid):
            if not sock.poll(POLL_MS):
                continue
            identity, body = sock.recv_multipart()
            match decoder.decode(body):
                case Stop():
                    return
                case ReadBlocks(ids, gather):
                    t0 = time.perf_counter()
                    key = tuple(ids)
                    if gather or key not in gathered:
                        gathered[key] = gather_blocks(kv_cache, torch.tensor(ids))
                    gather_s = time.perf_counter() - t0
                    # NOTE: copy=False hands zmq the tensors' memory (frames under zmq's copy
                    # threshold are copied all the same); pyzmq holds each array until sent.
                    frames = [t.view(torch.uint8).numpy() for t in gathered[key]]
                    sock.send_multipart(
                        [identity, encoder.encode(BlocksHeader(gather_s)), *frames], copy=False
                    )
    finally:
        sock.close(linger=0)
        ctx.term()


@dataclass(frozen=True, slots=True)
class ReadTiming:
    total_s: float
    gather_s: float  # on the server
    received_s: float  # request sent to last frame received
    scatter_s: float


class ZmqBlockReader:
    """The decode worker's end: starts the prefill worker's process, reads blocks from it;
    leaving the ``with`` block stops the child, whatever happened inside."""

    def __init__(self, layout: KVLayout, server_seed: int):
        self.layout = layout
        mp_ctx = mp.get_context("spawn")
        parent_conn, child_conn = mp_ctx.Pipe()
        self.server_process = mp_ctx.Process(
            target=serve_blocks_zmq,
            args=(layout, server_seed, os.getpid(), child_conn),
            daemon=True,
        )
        self._conn = parent_conn
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._encoder = msgspec.msgpack.Encoder()
        self._header_decoder = msgspec.msgpack.Decoder(BlocksHeader)

    def __enter__(self) -> ZmqBlockReader:
        self.server_process.start()
        try:
            if not self._conn.poll(START_TIMEOUT_S):
                raise TimeoutError(
                    f"the ZMQ server did not start in {START_TIMEOUT_S} s (exit code {self.server_process.exitcode})"
                )
            self._sock.connect(self._conn.recv())
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.server_process.is_alive():
            try:
                self._sock.send(self._encoder.encode(Stop()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # stop_process terminates it
        stop_process(self.server_process)
        self._sock.close(linger=0)
        self._ctx.term()
        self._conn.close()

    def _request(self, ids: list[int], gather: bool) -> tuple[BlocksHeader, list[zmq.Frame]]:
        self._sock.send(self._encoder.encode(ReadBlocks(ids, gather)))
        if not self._sock.poll(READ_TIMEOUT_S * 1000):
            raise TimeoutError(
                f"no blocks from the ZMQ server in {READ_TIMEOUT_S} s (alive: {self.server_process.is_alive()})"
            )
        header, *frames = self._sock.recv_multipart(copy=False)
        return self._header_decoder.decode(header.buffer), frames

    def read(
        self, src_ids: list[int], kv_cache: list[torch.Tensor], dst_ids: torch.Tensor
    ) -> ReadTiming:
        """Blocks ``src_ids`` of the server's KV cache into ``dst_ids`` of ``kv_cache``."""
        t0 = time.perf_counter()
        header, frames = self._request(src_ids, gather=True)
        t1 = time.perf_counter()
        n, lay = len(src_ids), self.layout
        shape = (2, n, lay.block_size, lay.num_kv_heads, lay.head_dim)
        blocks = [torch.frombuffer(f.buffer, dtype=torch.bfloat16).view(shape) for f in frames]
        scatter_blocks(kv_cache, dst_ids, blocks)
        t2 = time.perf_counter()
        return ReadTiming(t2 - t0, header.gather_s, t1 - t0, t2 - t1)

    def read_wire(self, src_ids: list[int]) -> int:
        """The bytes of blocks the server gathered before, received and dropped."""
        _, frames = self._request(src_ids, gather=False)
        return sum(len(f.buffer) for f in frames)


def bench_zmq(
    reader: ZmqBlockReader, layout: KVLayout, seed: int, n: int, repeats: int, warmup: int
) -> dict:
    nbytes = n * layout.bytes_per_block
    src_ids = block_ids(layout.num_blocks, n, seed=1)
    dst_ids = torch.tensor(block_ids(layout.num_blocks, n, seed=2))
    kv_cache = make_kv_cache(layout, seed=None)
    reader.read(src_ids, kv_cache, dst_ids)
    expected = make_kv_cache(layout, seed)
    assert same_blocks(kv_cache, dst_ids, expected, src_ids)
    del expected
    timings = [reader.read(src_ids, kv_cache, dst_ids) for _ in range(warmup + repeats)][warmup:]
    assert reader.read_wire(src_ids) == nbytes
    wire = median_s(lambda: reader.read_wire(src_ids), repeats, warmup)
    return {
        "read": figure(
            nbytes,
            [t.total_s for t in timings],
            gather_s=statistics.median(t.gather_s for t in timings),
            received_s=statistics.median(t.received_s for t in timings),
            scatter_s=statistics.median(t.scatter_s for t in timings),
        ),
        "wire": figure(nbytes, wire),
    }
