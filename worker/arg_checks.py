"""The worker's flags checked together, after parsing (``p.error``: exit 2 with the
reason): its scheduler link, lengths, ranks, tiers and P/D."""

from __future__ import annotations

import argparse

import torch
import zmq

from protocol.curve import CurveKeyError, load_keypair
from protocol.kv_transfer_config import parse_kv_transfer_config
from protocol.serve_flags import WORKER, rows_for
from protocol.serve_flags.flag import unaccepted
from worker.parallel.distributed import parse_init_method


def check_endpoint(endpoint: str) -> str | None:
    """Why ``endpoint`` is not one a ZeroMQ socket can connect to, or None."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.connect(endpoint)
    except zmq.ZMQError as e:
        return f"--scheduler {endpoint!r} is not a ZeroMQ endpoint ({e}); expected e.g. tcp://127.0.0.1:5556"
    finally:
        sock.close(linger=0)
        ctx.term()
    return None


def check_block_size_and_port(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    if a.block_size < 1:
        p.error(f"--block-size must be positive, got {a.block_size}")
    if not 0 <= a.http_port < 65536:
        p.error(f"--http-port must be 0..65535, got {a.http_port}")


def check_scheduler_link(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """--scheduler, --scheduler-timeout and the CURVE certificates."""
    if (why := check_endpoint(a.scheduler)) is not None:
        p.error(why)
    if a.scheduler_timeout <= 0:
        p.error(f"--scheduler-timeout must be positive, got {a.scheduler_timeout}")
    if (a.curve_client_key is None) != (a.curve_server_key is None):
        p.error("--curve-client-key and --curve-server-key go together")
    if a.curve_client_key is not None:
        try:
            load_keypair(a.curve_client_key)
            load_keypair(a.curve_server_key, need_secret=False)
        except CurveKeyError as e:
            p.error(str(e))


def check_lengths(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    if a.max_model_len is not None and a.max_model_len < 1:
        p.error(f"--max-model-len must be positive, got {a.max_model_len}")
    if a.max_num_batched_tokens < 1:
        p.error(f"--max-num-batched-tokens must be positive, got {a.max_num_batched_tokens}")
    if a.max_num_seqs < 1:
        p.error(f"--max-num-seqs must be positive, got {a.max_num_seqs}")


def check_ranks(p: argparse.ArgumentParser, a: argparse.Namespace, device: str) -> None:
    """--tensor-parallel-size, --rank and --distributed-init-method together."""
    if a.tensor_parallel_size < 1:
        p.error(f"--tensor-parallel-size must be positive, got {a.tensor_parallel_size}")
    if a.rank is not None and not 0 <= a.rank < a.tensor_parallel_size:
        p.error(f"--rank {a.rank} is outside 0..{a.tensor_parallel_size - 1} (--tensor-parallel-size {a.tensor_parallel_size})")
    if a.rank is not None and a.distributed_init_method is None:
        p.error("--rank needs --distributed-init-method (rank 0's address)")
    if a.distributed_init_method is not None:
        try:
            _, port = parse_init_method(a.distributed_init_method)
        except ValueError as e:
            p.error(str(e))
        if port == 0 and a.rank:
            p.error(f"--distributed-init-method {a.distributed_init_method!r}: rank {a.rank} needs rank 0's real port, not 0")
    if device == "cuda" and a.rank is None and a.tensor_parallel_size > torch.cuda.device_count():
        p.error(f"--tensor-parallel-size {a.tensor_parallel_size} on CUDA starts that many ranks on this host, one device each; "
                f"it has {torch.cuda.device_count()} (NCCL refuses two ranks on one device)")


def check_distributed_timeout(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    if a.distributed_timeout <= 0:
        p.error(f"--distributed-timeout must be positive, got {a.distributed_timeout}")
    if a.tensor_parallel_size > 1 and a.distributed_timeout <= a.scheduler_timeout:
        # NOTE: while rank 0 waits for WorkerReady it broadcasts nothing.
        p.error(f"--distributed-timeout {a.distributed_timeout:g} must be longer than --scheduler-timeout "
                f"{a.scheduler_timeout:g}: the other ranks wait that long for rank 0's handshake")


def check_external_tier(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """The external tier's flags name what its backend needs, and nothing of another's."""
    backend = a.kv_offloading_backend
    if backend == "disk":
        if not a.kv_offloading_path or not a.kv_offloading_disk_size:
            p.error("--kv-offloading-backend disk needs --kv-offloading-path DIR and --kv-offloading-disk-size GIB (> 0)")
    elif a.kv_offloading_path or a.kv_offloading_disk_size:
        p.error(f"--kv-offloading-path and --kv-offloading-disk-size are for --kv-offloading-backend disk, not {backend}")
    if backend == "mooncake":
        if not a.mooncake_master or not a.mooncake_metadata:
            p.error("--kv-offloading-backend mooncake needs --mooncake-master HOST:PORT and --mooncake-metadata URL")
    elif a.mooncake_master or a.mooncake_metadata:
        p.error(f"--mooncake-master and --mooncake-metadata are for --kv-offloading-backend mooncake, not {backend}")
    if backend != "native" and a.tensor_parallel_size > 1:
        p.error(f"--kv-offloading-backend {backend}: not with tensor parallelism yet (each rank would save its own heads)")


def check_kv_transfer(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """--kv-transfer-config, with what it does not work with yet."""
    if a.kv_transfer_config is None:
        return
    if a.tensor_parallel_size > 1:
        p.error("--kv-transfer-config: not with tensor parallelism yet (each rank holds its own heads)")
    if a.kv_offloading_backend != "native":
        p.error(f"--kv-transfer-config: not with --kv-offloading-backend {a.kv_offloading_backend} yet")


def check_table_values(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """The settings table's values: vLLM's choices the worker does not serve, and
    --kv-transfer-config parsed."""
    for row in rows_for(WORKER):
        if (line := unaccepted(row, getattr(a, row.dest))) is not None:
            p.error(line)
    if a.kv_transfer_config is not None:
        try:
            a.kv_transfer_config = parse_kv_transfer_config(a.kv_transfer_config)
        except ValueError as e:
            p.error(str(e))
