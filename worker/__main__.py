"""``python -m worker`` / ``kvpool-worker``: the worker process's entry.

Builds the one frozen WorkerConfig from the command line (``worker.args``; a bad flag
exits 2 with argparse's usage and the reason), then hands it to ``worker.startup``,
which loads the checkpoint, sizes and allocates the KV cache and runs the process loop.
"""

from __future__ import annotations

import logging
import sys

import torch

from protocol.serve_flags.model import one_name
from worker.arg_checks import (
    check_block_size_and_port,
    check_distributed_timeout,
    check_external_tier,
    check_kv_transfer,
    check_lengths,
    check_ranks,
    check_scheduler_link,
    check_table_values,
)
from worker.args import build_parser, join_negative_values
from worker.config import WorkerConfig
from worker.startup import run


def config_from_args(argv: list[str] | None = None) -> WorkerConfig:
    p = build_parser()
    a = p.parse_args(join_negative_values(sys.argv[1:] if argv is None else list(argv)))
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available (torch.cuda.is_available() is False)")
    check_table_values(p, a)
    d = WorkerConfig()
    served_model_name = one_name(a.served_model_name) or d.served_model_name
    if a.max_num_batched_tokens is None:
        a.max_num_batched_tokens = d.max_num_batched_tokens
    a.cpu_nice = d.cpu_nice if a.cpu_nice is None else a.cpu_nice
    check_block_size_and_port(p, a)
    check_scheduler_link(p, a)
    check_lengths(p, a)
    check_ranks(p, a, device)
    if not 0 <= a.cpu_nice <= 19:
        p.error(f"--cpu-nice must be 0..19 (a nice value; lowering the priority needs no privilege), got {a.cpu_nice}")
    if a.num_gpu_blocks_override is not None and a.num_gpu_blocks_override < 2:
        p.error(f"--num-gpu-blocks-override must be at least 2 (block 0 is the null block), got {a.num_gpu_blocks_override}")
    if a.cpu_wide_step_tokens is not None and a.cpu_wide_step_tokens < 0:
        p.error(f"--cpu-wide-step-tokens must be >= 0 (0: never), got {a.cpu_wide_step_tokens}")
    check_distributed_timeout(p, a)
    check_external_tier(p, a)
    check_kv_transfer(p, a)
    return WorkerConfig(
        scheduler=a.scheduler, model=a.model, device=device, dtype=a.dtype, kv_cache_dtype=a.kv_cache_dtype, max_model_len=a.max_model_len,
        kv_cache_memory=a.kv_cache_memory, num_gpu_blocks_override=a.num_gpu_blocks_override,
        gpu_memory_utilization=a.gpu_memory_utilization,
        max_num_batched_tokens=a.max_num_batched_tokens, max_num_seqs=a.max_num_seqs, block_size=a.block_size, kv_offloading_size=a.kv_offloading_size, seed=a.seed, http_port=a.http_port,
        served_model_name=served_model_name,
        log_level=a.log_level, scheduler_timeout_s=a.scheduler_timeout, reconnect=a.reconnect,
        curve_client_key=a.curve_client_key, curve_server_key=a.curve_server_key,
        tensor_parallel_size=a.tensor_parallel_size, rank=a.rank, distributed_init_method=a.distributed_init_method,
        distributed_timeout_s=a.distributed_timeout, cpu_nice=a.cpu_nice, cpu_wide_step_tokens=a.cpu_wide_step_tokens,
        serve_pid=a.serve_pid,
        kv_offloading_backend="" if a.kv_offloading_backend == "native" else a.kv_offloading_backend,
        kv_offloading_path=a.kv_offloading_path, kv_offloading_disk_bytes=int((a.kv_offloading_disk_size or 0) * 2**30),
        mooncake_master=a.mooncake_master, mooncake_metadata=a.mooncake_metadata, kv_transfer=a.kv_transfer_config,
        disable_sliding_window=a.disable_sliding_window, disable_hybrid_kv_cache_manager=a.disable_hybrid_kv_cache_manager,
    )


def main(argv: list[str] | None = None) -> int:
    config = config_from_args(argv)
    logging.basicConfig(level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run(config, sys.argv[1:] if argv is None else list(argv))


if __name__ == "__main__":
    sys.exit(main())
