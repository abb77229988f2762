"""The worker's start-up, once its command line is a WorkerConfig (``worker.__main__``).

Joins or starts the tensor-parallel group (rank 0 without ``--rank`` starts the other
ranks on this host), loads the checkpoint, sizes the KV cache from the memory budget and
allocates it (``num_kv_tensors`` tensors of the model's KV-cache groups, shared by
layers of different groups; and the host tier), serves /metrics, then runs the process loop
(``worker.process``, or one rank of a group: ``worker.parallel.rank_group``) against the
scheduler's worker port. A checkpoint that cannot be served, or a KV budget the device
cannot hold, exits 2 before hello.
"""

from __future__ import annotations

import logging
import os
import signal

import torch
import zmq

from protocol.kv_cache_spec import num_kv_tensors
from worker.attention.kv_quant import kv_cache_torch_dtype
from worker.config import CPU_DEFAULT_KV_CACHE_MEMORY, WorkerConfig
from worker.cpu.threads import lower_cpu_priority, set_cpu_threads
from worker.external.external_io import ExternalIO
from worker.external.open_tier import open_external_tier
from worker.kv.device_memory import check_host_tier_budget, check_kv_budget
from worker.kv.kv_cache import (
    allocate_host_kv_caches,
    allocate_kv_caches,
    cuda_kv_budget,
    kv_bytes_per_block,
    layer_kv_caches,
    num_blocks_for_budget,
)
from worker.load.checkpoint import CheckpointError
from worker.load.serving_model import ServingModel, check_shardable, load_serving_model
from worker.metrics import WorkerMetrics
from worker.models.config import DTYPES, ModelConfigError
from worker.parallel.distributed import GroupError, TPGroup
from worker.parallel.rank_group import LocalRanks, rank_device, run_rank, threads_per_rank
from worker.process import WorkerProcess
from worker.scheduler_link import WorkerStopping
from worker.step.group_tables import hello_group_windows
from worker.transfer.kv_transfer import KVTransfer, open_kv_transfer

log = logging.getLogger("worker")


class StartupError(Exception):
    """Start-up cannot go on (exit 2 before hello); the message says why."""


def run(config: WorkerConfig, argv: list[str]) -> int:
    """Start the worker ``config`` describes and serve until it stops; the exit code.
    ``argv`` is its command line, which rank 0 passes on to the ranks it starts."""
    if config.device == "cpu":
        nice = lower_cpu_priority(config.cpu_nice)
        log.info("torch uses %d CPU thread(s), at nice %d", set_cpu_threads(), nice)
    group = local_ranks = None
    try:
        if config.tensor_parallel_size > 1:
            if config.rank is None:
                check_shardable(config.model, config.tensor_parallel_size)
            group, local_ranks = start_group(config, argv)
        device = config.device if group is None else str(group.device)
        serving = load_serving_model(config.model, config.dtype, device, config.max_model_len, group, config.block_size,
                                     config.kv_cache_dtype, config.disable_sliding_window, config.disable_hybrid_kv_cache_manager)
        if group is not None:
            group.start()
        return _serve(config, serving, group)
    except (CheckpointError, ModelConfigError) as e:
        log.error("cannot serve this checkpoint: %s", e)
        return 2
    except GroupError as e:
        log.error("%s", e)
        return 2
    finally:
        if group is not None:
            group.close()
        if local_ranks is not None:
            local_ranks.stop()


def start_group(config: WorkerConfig, argv: list[str]) -> tuple[TPGroup, LocalRanks | None]:
    """This rank's group; rank 0 without --rank first starts ranks 1..N-1 here."""
    n, rank = config.tensor_parallel_size, config.rank or 0
    # NOTE: rank 0 listens first (on port 0: a free loopback port), then starts the others.
    init_method = config.distributed_init_method or "tcp://127.0.0.1:0"
    group = TPGroup(rank, n, init_method, rank_device(config.device, rank), config.distributed_timeout_s, config.distributed_timeout_s)
    if config.rank is not None:
        return group, None
    per_rank = threads_per_rank(n)
    if config.device == "cpu" and not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(per_rank)
    local = LocalRanks(argv, n, group.init_method, per_rank)
    log.info("rank 0 of %d: started ranks 1..%d (pids %s), store at %s", n, n - 1, local.pids, group.init_method)
    return group, local


def _serve(config: WorkerConfig, serving: ServingModel, group: TPGroup | None) -> int:
    m, model = serving.config, serving.model
    log.info("%s from %s: %s, %s on %s, loaded in %.2f s", m.architecture, serving.directory, serving.identity,
             serving.dtype, model.device, serving.load_seconds)
    try:
        kv_caches, per_block = allocate_worker_kv_caches(config, serving, group)
        host_caches = None
        if config.kv_offloading_size > 0:
            host_caches = _allocate_host_tier(config, group, kv_caches, per_block)
        metrics = _start_metrics(config, group)
        external = open_external_tier(config, serving, kv_caches)
        transfer = open_kv_transfer(config.kv_transfer, serving, kv_caches, config.block_size)
    except (StartupError, ValueError) as e:
        log.error("%s", e)
        return 2
    try:
        return _run_process_loop(config, serving, kv_caches, metrics, group, host_caches, external, transfer)
    finally:
        if transfer is not None:
            transfer.close()
        if external is not None:
            try:
                external.close()
            except WorkerStopping:
                pass  # SIGTERM while the queue drains: it stops as it is


def _kv_budget(config: WorkerConfig, serving: ServingModel, kv_dtype: torch.dtype) -> int:
    """Bytes for the KV cache: --kv-cache-memory, else on CUDA what the device has left
    under --gpu-memory-utilization after a profiled serving step (its peak counts the
    buffers the runner allocates after the cache: ``worker.kv.profile``), else the CPU default."""
    if config.kv_cache_memory is not None:
        return config.kv_cache_memory
    if config.device == "cuda":
        from worker.kv.profile import dummy_step, profile_step_peak

        step = dummy_step(config.max_num_batched_tokens, config.max_num_seqs, serving.max_model_len, config.block_size)
        peak = profile_step_peak(serving.model, step, kv_dtype, list(serving.kv_scales) or None, max(1, len(serving.kv_cache_groups)))
        try:
            budget = cuda_kv_budget(serving.model.device, config.gpu_memory_utilization, peak, serving.memory_before_load)
        except ValueError as e:
            raise StartupError(str(e)) from None
        log.info("peak of a profiled step (%d tokens in %d requests, %d rows sampled): %d bytes", step.num_tokens,
                 len(step.lengths), step.max_num_seqs, peak)
        return budget
    return CPU_DEFAULT_KV_CACHE_MEMORY


def _num_kv_blocks(config: WorkerConfig, serving: ServingModel, kv_dtype: torch.dtype, per_block: int) -> tuple[int, int, str]:
    """The KV blocks to allocate, their budget in bytes, and the flag that sized them."""
    if config.num_gpu_blocks_override is None:
        budget = _kv_budget(config, serving, kv_dtype)
        return num_blocks_for_budget(budget, per_block), budget, "--kv-cache-memory"
    # NOTE: as vLLM (kv_cache_utils.may_override_num_blocks): the override is the count,
    # above or below what the budget holds; only what the device has bounds it.
    num_blocks = config.num_gpu_blocks_override
    return num_blocks, num_blocks * per_block, "--num-gpu-blocks-override"


def allocate_worker_kv_caches(config: WorkerConfig, serving: ServingModel, group: TPGroup | None) -> tuple[list[torch.Tensor], int]:
    """The device KV caches, one entry per layer (layers of different KV-cache groups
    share a tensor), as many blocks as the budget holds; and the bytes of one block."""
    m, model = serving.config, serving.model
    dtype = kv_cache_torch_dtype(config.kv_cache_dtype, DTYPES[serving.dtype])
    groups = list(serving.kv_cache_groups)
    num_tensors = num_kv_tensors(groups) if groups else m.num_layers
    # NOTE: under tensor parallelism this rank's KV heads only; the pool is the smallest count over ranks.
    per_block = kv_bytes_per_block(num_tensors, config.block_size, model.num_kv_heads, m.head_dim, dtype)
    num_blocks, budget, flag = _num_kv_blocks(config, serving, dtype, per_block)
    if groups and hello_group_windows(groups):
        log.info("hybrid KV-cache groups (window: layers) %s: %d KV tensors for %d layers",
                 ", ".join(f"{g.sliding_window}: {g.layer_ids}" for g in groups), num_tensors, m.num_layers)
    if group is not None:
        num_blocks = group.min_over_ranks("num_blocks", num_blocks)
    if num_blocks < 2:
        raise StartupError(f"a KV budget of {budget} bytes holds {num_blocks} blocks of {per_block} bytes; at least 2 are needed")
    log.info("device %s, KV cache dtype %s: %d KV blocks of %d bytes fit a budget of %d bytes", model.device, dtype, num_blocks, per_block, budget)
    try:
        check_kv_budget(num_blocks * per_block, model.device, flag=flag)
        kv_caches = allocate_kv_caches(num_tensors, num_blocks, config.block_size, model.num_kv_heads, m.head_dim, dtype, model.device)
        if groups:
            kv_caches = layer_kv_caches(kv_caches, groups)
    except (ValueError, RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
        raise StartupError(f"cannot allocate the KV cache ({num_blocks} blocks of {per_block} bytes): {e}") from None
    return kv_caches, per_block


def _allocate_host_tier(config: WorkerConfig, group: TPGroup | None, kv_caches: list[torch.Tensor], per_block: int) -> list[torch.Tensor]:
    """The offload tier: as many blocks as --kv-offloading-size holds, in host memory,
    one host tensor per distinct KV tensor (a hybrid model's shared tensors once): a slot
    holds ``per_block`` bytes, a block's whole KV whichever KV-cache group holds it."""
    num_host = int(config.kv_offloading_size * 2**30) // per_block
    if group is not None:
        num_host = group.min_over_ranks("num_host_blocks", num_host)
    if num_host < 1:
        raise StartupError(f"--kv-offloading-size {config.kv_offloading_size:g} GiB holds no KV block of {per_block} bytes")
    try:
        check_host_tier_budget(num_host * per_block)
        host_caches = allocate_host_kv_caches(kv_caches, num_host)
    except (ValueError, RuntimeError, MemoryError) as e:
        raise StartupError(f"cannot allocate the host KV tier ({num_host} blocks of {per_block} bytes): {e}") from None
    log.info("host KV tier: %d blocks of %d bytes (%g GiB)%s", num_host, per_block, config.kv_offloading_size,
             ", pinned" if host_caches[0].is_pinned() else "")
    return host_caches


def _start_metrics(config: WorkerConfig, group: TPGroup | None) -> WorkerMetrics | None:
    """/metrics and /health on 127.0.0.1, on rank 0 only; None with --http-port 0."""
    if not config.http_port or (group is not None and group.rank != 0):
        return None
    metrics = WorkerMetrics(config.served_model_name)
    try:
        metrics.serve(config.http_port)
    except OSError as e:
        raise StartupError(f"cannot serve /metrics on 127.0.0.1:{config.http_port}: {e} (choose another --http-port, or 0 to disable)") from None
    return metrics


def _on_sigterm(_signum, _frame) -> None:
    # NOTE: once: the stop is under way, and a second SIGTERM (kvpool serve's, after the
    # process group's) raised again inside its clean-up (the goodbye's linger, the
    # context's term) would end it with a traceback instead of status 0.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise WorkerStopping()


def _run_process_loop(config: WorkerConfig, serving: ServingModel, kv_caches: list[torch.Tensor], metrics: WorkerMetrics | None,
                      group: TPGroup | None, host_caches: list[torch.Tensor] | None, external: ExternalIO | None = None,
                      transfer: KVTransfer | None = None) -> int:
    ctx = zmq.Context()
    try:
        # NOTE: only now, with a scheduler to tell; before, SIGTERM simply ends the process.
        signal.signal(signal.SIGTERM, _on_sigterm)
        if group is not None:
            return run_rank(config, serving, kv_caches, metrics, group, ctx, host_caches)
        return WorkerProcess(config, serving, kv_caches, metrics, host_caches, external, transfer).run(ctx)
    except WorkerStopping:
        return 0
    except KeyboardInterrupt:
        return 130
    finally:
        ctx.destroy(linger=0)
