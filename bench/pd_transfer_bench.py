"""KV blocks between two worker processes on one host (issue #49, prefill/decode
disaggregation): ZMQ and Mooncake's Transfer Engine on loopback, against a plain memory
copy of the same bytes (``python -m bench.pd_transfer_bench [--blocks 1 8 64 256]``).

The payload is KV blocks shaped as SmolLM2-135M's in bf16: 30 layers, 3 KV heads of 64,
block size 16, so a block is 30 x 2 x 16 x 3 x 64 x 2 bytes. Each worker holds one KV
tensor per layer, (2, num_blocks, block_size, kv_heads, head_dim), as the real worker does;
a transfer reads N blocks at scattered ids of the prefill worker's tensors into other
scattered ids of the decode worker's.

* memcpy: one process copies N blocks' bytes into a preallocated buffer (torch ``copy_``,
  numpy ``copyto``); and gathers then scatters the same blocks between two KV tensors in
  one process (the work a transfer adds to the copy, without the wire).
* zmq: the decode worker (this process, a DEALER) asks the prefill worker (a child
  process, a ROUTER on tcp://127.0.0.1) for N blocks; the server gathers them per layer
  (``index_select``) and sends one frame per layer with ``copy=False``; the reader writes
  them into its own tensors (``index_copy_``). "read" times request to blocks written;
  "wire" asks for blocks the server gathered before and writes nothing.
* mooncake: a Transfer Engine ("tcp", P2PHANDSHAKE, 127.0.0.1) in each of two child
  processes, each registering its KV tensors and one contiguous buffer. "kv" reads the N
  blocks' K and V of every layer (2 x 30 x N segments, one ``batch_transfer_sync_read``)
  straight into the reader's KV tensors at other ids; "wire" reads N blocks' bytes from the
  peer's contiguous buffer into the local one (``transfer_sync_read``). The segment lists
  are built before the clock starts.

Each figure is the median of ``--repeats`` runs after ``--warmup``; GB/s is 1e9 bytes
per second of payload. Every transfer is checked byte for byte once per size. Prints a
markdown table and writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import msgspec
import numpy as np
import torch
import zmq

DEFAULT_BLOCKS = (1, 8, 64, 256)
START_TIMEOUT_S = 60.0
READ_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 5.0
# NOTE: a child checks this often whether its parent is gone, so a killed bench leaves
# no server behind.
POLL_MS = 500
# NOTE: Mooncake's tcp transport fails a batch at once (-1, "TCP lane queue-full") past its
# per-peer queue (MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER and _MAX_PENDING_ADMISSIONS_PER_PEER,
# 1024 each by default), one entry per segment here: the KV read goes in batches of this many.
TE_SEGMENTS_PER_BATCH = 1024


@dataclass(frozen=True, slots=True)
class KVLayout:
    """One worker's KV cache: ``num_layers`` tensors of (2, num_blocks, block_size,
    num_kv_heads, head_dim) in bf16."""

    num_layers: int = 30
    num_kv_heads: int = 3
    head_dim: int = 64
    block_size: int = 16
    num_blocks: int = 512

    @property
    def layer_shape(self) -> tuple[int, int, int, int, int]:
        return (2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_half_block(self) -> int:
        """One block's K (or V) in one layer: the contiguous unit of the layout."""
        return self.block_size * self.num_kv_heads * self.head_dim * 2

    @property
    def bytes_per_block(self) -> int:
        return self.num_layers * 2 * self.bytes_per_half_block


def make_kv_cache(layout: KVLayout, seed: int | None) -> list[torch.Tensor]:
    """One KV tensor per layer, random from ``seed`` (the same on every process), zeros
    for ``None``."""
    if seed is None:
        return [
            torch.zeros(layout.layer_shape, dtype=torch.bfloat16) for _ in range(layout.num_layers)
        ]
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(layout.layer_shape, generator=g, dtype=torch.bfloat16)
        for _ in range(layout.num_layers)
    ]


def block_ids(num_blocks: int, n: int, seed: int) -> list[int]:
    """``n`` distinct ids scattered over the pool, as a block table's are."""
    return torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))[:n].tolist()


def gather_blocks(kv_cache: list[torch.Tensor], ids: torch.Tensor) -> list[torch.Tensor]:
    return [layer.index_select(1, ids) for layer in kv_cache]  # num_layers x (2, n, bs, h, d)


def scatter_blocks(
    kv_cache: list[torch.Tensor], ids: torch.Tensor, blocks: list[torch.Tensor]
) -> None:
    for layer, src in zip(kv_cache, blocks, strict=True):
        layer.index_copy_(1, ids, src)


def same_blocks(got: list[torch.Tensor], got_ids, want: list[torch.Tensor], want_ids) -> bool:
    """Whether blocks ``got_ids`` of one KV cache hold blocks ``want_ids`` of another, byte
    for byte (bf16 compared as int16, so NaN and -0.0 too)."""
    return all(
        torch.equal(g[:, got_ids].view(torch.int16), w[:, want_ids].view(torch.int16))
        for g, w in zip(got, want, strict=True)
    )


def median_s(fn: Callable[[], object], repeats: int, warmup: int) -> list[float]:
    """Seconds per call of ``fn``, ``repeats`` samples after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return samples


def figure(nbytes: int, samples: list[float], **extra: float) -> dict:
    med = statistics.median(samples)
    return {"median_s": med, "gbps": nbytes / med / 1e9, "samples_s": samples, **extra}


def stop_process(proc: mp.process.BaseProcess, timeout: float = STOP_TIMEOUT_S) -> None:
    """Wait for ``proc`` to exit, then terminate it, then kill it; each wait bounded."""
    proc.join(timeout)
    if proc.is_alive():
        proc.terminate()
        proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join(timeout)


def orphaned(parent_pid: int) -> bool:
    return os.getppid() != parent_pid


# ---------------------------------------------------------------- memcpy (one process)


def bench_memcpy(layout: KVLayout, n: int, repeats: int, warmup: int) -> dict:
    nbytes = n * layout.bytes_per_block
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    src_np, dst_np = src.numpy(), np.empty(nbytes, dtype=np.uint8)
    kv_src, kv_dst = make_kv_cache(layout, seed=0), make_kv_cache(layout, seed=None)
    src_ids = torch.tensor(block_ids(layout.num_blocks, n, seed=1))
    dst_ids = torch.tensor(block_ids(layout.num_blocks, n, seed=2))
    out = {
        "torch_copy": figure(nbytes, median_s(lambda: dst.copy_(src), repeats, warmup)),
        "numpy_copyto": figure(
            nbytes, median_s(lambda: np.copyto(dst_np, src_np), repeats, warmup)
        ),
        "gather_scatter": figure(
            nbytes,
            median_s(
                lambda: scatter_blocks(kv_dst, dst_ids, gather_blocks(kv_src, src_ids)),
                repeats,
                warmup,
            ),
        ),
    }
    assert torch.equal(dst, src) and np.array_equal(dst_np, src_np)
    assert same_blocks(kv_dst, dst_ids, kv_src, src_ids)
    return out


# ---------------------------------------------------------------- ZMQ


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


# ---------------------------------------------------------------- Mooncake Transfer Engine


def start_transfer_engine(kv_cache: list[torch.Tensor], staging: torch.Tensor):
    """A Transfer Engine on 127.0.0.1 ("tcp", P2PHANDSHAKE) with ``kv_cache`` and
    ``staging`` registered; RuntimeError with the call and its code otherwise."""
    # NOTE: imported here, in the child only: Mooncake is optional, and a failure to load
    # it must become a line of the results, not the bench's end.
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if (rc := engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")) != 0:
        raise RuntimeError(
            f"TransferEngine.initialize('127.0.0.1', 'P2PHANDSHAKE', 'tcp', '') returned {rc}"
        )
    tensors = [*kv_cache, staging]
    ptrs, sizes = [t.data_ptr() for t in tensors], [t.numel() * t.element_size() for t in tensors]
    if (rc := engine.batch_register_memory(ptrs, sizes)) != 0:
        raise RuntimeError(f"TransferEngine.batch_register_memory returned {rc}")
    return engine


def staging_bytes(kv_cache: list[torch.Tensor], ids: list[int]) -> torch.Tensor:
    """The blocks ``ids`` gathered and laid end to end, layer after layer, as bytes."""
    return torch.cat([t.reshape(-1) for t in gather_blocks(kv_cache, torch.tensor(ids))]).view(
        torch.uint8
    )


def half_block_addresses(kv_ptrs: list[int], layout: KVLayout, ids: list[int]) -> list[int]:
    """The address of each block's K and V in each layer, in one order for both ends."""
    unit = layout.bytes_per_half_block
    return [
        ptr + (kv * layout.num_blocks + b) * unit for ptr in kv_ptrs for kv in (0, 1) for b in ids
    ]


def serve_blocks_te(
    layout: KVLayout, seed: int, max_blocks: int, parent_pid: int, conn: Connection
) -> None:
    """The prefill worker: its KV tensors and a staging buffer holding the first
    ``max_blocks`` ids' blocks, registered; sends its session and addresses (or the
    error), then waits for a word on ``conn`` or its parent's end."""
    try:
        kv_cache = make_kv_cache(layout, seed)
        staging = staging_bytes(kv_cache, block_ids(layout.num_blocks, max_blocks, seed=1))
        engine = start_transfer_engine(kv_cache, staging)
        peer = {
            "session": f"127.0.0.1:{engine.get_rpc_port()}",
            "kv_ptrs": [t.data_ptr() for t in kv_cache],
            "staging_ptr": staging.data_ptr(),
        }
    except Exception as e:  # noqa: BLE001 -- the reason goes into the results
        conn.send({"error": f"{type(e).__name__}: {e}"})
        return
    conn.send(peer)
    while not orphaned(parent_pid) and not conn.poll(POLL_MS / 1000):
        pass


def read_blocks_te(
    layout: KVLayout,
    seed: int,
    sizes: list[int],
    repeats: int,
    warmup: int,
    peer: dict,
    conn: Connection,
) -> None:
    """The decode worker: for each size, the KV read and the wire read from ``peer``,
    checked once, then timed; sends the figures (or the error) on ``conn``."""
    try:
        reader = TeReader(layout, seed, max(sizes), peer)
        conn.send({n: reader.bench(n, repeats, warmup) for n in sizes})
    except Exception as e:  # noqa: BLE001 -- the reason goes into the results
        conn.send({"error": f"{type(e).__name__}: {e}"})


class TeReader:
    """The decode worker's Transfer Engine, its KV tensors, and what it should read."""

    def __init__(self, layout: KVLayout, seed: int, max_blocks: int, peer: dict):
        self.layout, self.peer = layout, peer
        self.kv_cache = make_kv_cache(layout, seed=None)
        self.staging = torch.empty(max_blocks * layout.bytes_per_block, dtype=torch.uint8)
        self.engine = start_transfer_engine(self.kv_cache, self.staging)
        self.expected = make_kv_cache(layout, seed)  # the server's KV cache
        self.expected_staging = staging_bytes(
            self.expected, block_ids(layout.num_blocks, max_blocks, seed=1)
        )

    def read_kv(self, local: list[int], remote: list[int], lengths: list[int]) -> None:
        for i in range(0, len(local), TE_SEGMENTS_PER_BATCH):
            batch = slice(i, i + TE_SEGMENTS_PER_BATCH)
            rc = self.engine.batch_transfer_sync_read(
                self.peer["session"], local[batch], remote[batch], lengths[batch]
            )
            if rc != 0:
                raise RuntimeError(
                    f"batch_transfer_sync_read of {len(local[batch])} segments returned {rc}"
                )

    def read_wire(self, nbytes: int) -> None:
        if (
            rc := self.engine.transfer_sync_read(
                self.peer["session"], self.staging.data_ptr(), self.peer["staging_ptr"], nbytes
            )
        ) != 0:
            raise RuntimeError(f"transfer_sync_read of {nbytes} bytes returned {rc}")

    def bench(self, n: int, repeats: int, warmup: int) -> dict:
        lay, nbytes = self.layout, n * self.layout.bytes_per_block
        src_ids, dst_ids = (
            block_ids(lay.num_blocks, n, seed=1),
            block_ids(lay.num_blocks, n, seed=2),
        )
        remote = half_block_addresses(self.peer["kv_ptrs"], lay, src_ids)
        local = half_block_addresses([t.data_ptr() for t in self.kv_cache], lay, dst_ids)
        lengths = [lay.bytes_per_half_block] * len(local)
        self.read_kv(local, remote, lengths)
        self.read_wire(nbytes)
        assert same_blocks(self.kv_cache, dst_ids, self.expected, src_ids)
        assert torch.equal(self.staging[:nbytes], self.expected_staging[:nbytes])
        return {
            "kv": figure(
                nbytes,
                median_s(lambda: self.read_kv(local, remote, lengths), repeats, warmup),
                segments=len(local),
                batches=-(-len(local) // TE_SEGMENTS_PER_BATCH),
            ),
            "wire": figure(nbytes, median_s(lambda: self.read_wire(nbytes), repeats, warmup)),
        }


def bench_mooncake(
    layout: KVLayout, seed: int, sizes: list[int], repeats: int, warmup: int, timeout_s: float
) -> dict:
    """``{n: figures}`` from two child processes, or ``{"error": why}``."""
    mp_ctx = mp.get_context("spawn")
    server_conn, server_end = mp_ctx.Pipe()
    reader_conn, reader_end = mp_ctx.Pipe()
    server = mp_ctx.Process(
        target=serve_blocks_te,
        args=(layout, seed, max(sizes), os.getpid(), server_end),
        daemon=True,
    )
    reader = None
    try:
        server.start()
        if not server_conn.poll(START_TIMEOUT_S):
            return {
                "error": f"the Transfer Engine server did not start in {START_TIMEOUT_S} s (exit code {server.exitcode})"
            }
        peer = server_conn.recv()
        if "error" in peer:
            return {"error": f"server: {peer['error']}"}
        reader = mp_ctx.Process(
            target=read_blocks_te,
            args=(layout, seed, sizes, repeats, warmup, peer, reader_end),
            daemon=True,
        )
        reader.start()
        if not reader_conn.poll(timeout_s):
            return {
                "error": f"no figures from the Transfer Engine reader in {timeout_s} s (exit code {reader.exitcode})"
            }
        return reader_conn.recv()
    except EOFError:
        return {
            "error": f"a Transfer Engine process died (server exit code {server.exitcode}, reader {reader and reader.exitcode})"
        }
    finally:
        if server.is_alive():
            server_conn.send("stop")
        for proc in (reader, server):
            if proc is not None and proc.pid is not None:
                stop_process(proc)


# ---------------------------------------------------------------- the run


@dataclass(frozen=True, slots=True)
class BenchConfig:
    blocks: tuple[int, ...]
    repeats: int
    warmup: int
    transports: tuple[str, ...]
    mooncake_timeout_s: float
    out: Path


def run(cfg: BenchConfig) -> dict:
    layout = KVLayout(num_blocks=2 * max(cfg.blocks))
    seed = 0
    results: dict[int, dict] = {n: {} for n in cfg.blocks}
    load_before = os.getloadavg()
    if "memcpy" in cfg.transports:
        for n in cfg.blocks:
            results[n]["memcpy"] = bench_memcpy(layout, n, cfg.repeats, cfg.warmup)
    if "zmq" in cfg.transports:
        with ZmqBlockReader(layout, seed) as reader:
            for n in cfg.blocks:
                results[n]["zmq"] = bench_zmq(reader, layout, seed, n, cfg.repeats, cfg.warmup)
    mooncake_error = None
    if "mooncake" in cfg.transports:
        te = bench_mooncake(
            layout, seed, list(cfg.blocks), cfg.repeats, cfg.warmup, cfg.mooncake_timeout_s
        )
        mooncake_error = te.get("error")
        for n in cfg.blocks if mooncake_error is None else ():
            results[n]["mooncake"] = te[n]
    return {
        "config": {**asdict(cfg), "out": str(cfg.out)},
        "layout": {
            **asdict(layout),
            "dtype": "bfloat16",
            "bytes_per_block": layout.bytes_per_block,
        },
        "machine": {
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
            "versions": {
                "torch": torch.__version__,
                "pyzmq": zmq.__version__,
                "libzmq": zmq.zmq_version(),
                "numpy": np.__version__,
            },
        },
        "mooncake_error": mooncake_error,
        "results": {str(n): r for n, r in results.items()},
    }


COLUMNS = [
    ("torch copy_", ("memcpy", "torch_copy")),
    ("numpy copyto", ("memcpy", "numpy_copyto")),
    ("gather+scatter, 1 proc", ("memcpy", "gather_scatter")),
    ("ZMQ read", ("zmq", "read")),
    ("ZMQ wire", ("zmq", "wire")),
    ("TE kv read", ("mooncake", "kv")),
    ("TE wire", ("mooncake", "wire")),
]


def markdown_table(report: dict) -> str:
    """GB/s per size and transport; the last column, ZMQ's whole read over torch's copy."""
    bpb = report["layout"]["bytes_per_block"]
    lines = [
        "| blocks | MiB | " + " | ".join(name for name, _ in COLUMNS) + " | ZMQ read / copy_ |",
        "|---:" * (len(COLUMNS) + 3) + "|",
    ]
    for n, r in report["results"].items():
        cells = [f"{r[t][k]['gbps']:.2f}" if t in r else "-" for _, (t, k) in COLUMNS]
        ratio = (
            f"{r['zmq']['read']['gbps'] / r['memcpy']['torch_copy']['gbps']:.0%}"
            if "zmq" in r and "memcpy" in r
            else "-"
        )
        lines.append(f"| {n} | {int(n) * bpb / 2**20:.1f} | " + " | ".join(cells) + f" | {ratio} |")
    if report["mooncake_error"]:
        lines.append(f"\nMooncake Transfer Engine did not run: {report['mooncake_error']}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.pd_transfer_bench", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--blocks",
        type=int,
        nargs="+",
        default=list(DEFAULT_BLOCKS),
        help="blocks per transfer (default: %(default)s)",
    )
    p.add_argument(
        "--repeats", type=int, default=10, help="timed runs per figure; the median is reported"
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed runs before them")
    p.add_argument(
        "--transports",
        nargs="+",
        choices=["memcpy", "zmq", "mooncake"],
        default=["memcpy", "zmq", "mooncake"],
    )
    p.add_argument(
        "--mooncake-timeout-s",
        type=float,
        default=300.0,
        help="bound on the Transfer Engine reader's whole run",
    )
    p.add_argument("--out", type=Path, default=Path("out/pd-transfer/results.json"))
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if min(args.blocks) < 1 or args.repeats < 1 or args.warmup < 0:
        raise SystemExit("--blocks must be >= 1, --repeats >= 1, --warmup >= 0")
    cfg = BenchConfig(
        tuple(args.blocks),
        args.repeats,
        args.warmup,
        tuple(args.transports),
        args.mooncake_timeout_s,
        args.out,
    )
    report = run(cfg)
    print(markdown_table(report))
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    cfg.out.write_text(json.dumps(report, indent=2))
    print(
        f"\nGB/s = 1e9 bytes/s, median of {cfg.repeats} after {cfg.warmup} warm-up; JSON: {cfg.out}"
    )


if __name__ == "__main__":
    main()
