"""Mooncake's Transfer Engine for bench/pd_transfer_bench.py: two child processes, each
registering its KV tensors and a buffer; reads in place and of one buffer."""

from __future__ import annotations

import multiprocessing as mp
import os
from multiprocessing.connection import Connection

import torch

from bench.pd_transfer_parts import (
    POLL_MS,
    START_TIMEOUT_S,
    TE_SEGMENTS_PER_BATCH,
    KVLayout,
    block_ids,
    figure,
    gather_blocks,
    make_kv_cache,
    median_s,
    orphaned,
    same_blocks,
    stop_process,
)


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
