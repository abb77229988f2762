"""``python -m worker`` / ``kvpool-worker``: the worker process.

Builds the one frozen WorkerConfig from the command line, loads the checkpoint
(``--model DIR``, or the tiny default generated on first use), sizes the KV cache from
the memory budget, allocates it, then runs the process loop (``worker.process``)
against the scheduler's worker port. A checkpoint that cannot be served, or a KV
budget the device cannot hold, exits 2 before hello.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys

import torch
import zmq

from protocol.curve import CurveKeyError, load_keypair
from worker.checkpoint import CheckpointError
from worker.config import CPU_DEFAULT_KV_CACHE_MEMORY, WorkerConfig
from worker.device_memory import check_host_tier_budget, check_kv_budget
from worker.kv_cache import (
    allocate_host_kv_caches,
    allocate_kv_caches,
    cuda_kv_budget,
    kv_bytes_per_block,
    num_blocks_for_budget,
    parse_size,
)
from worker.metrics import WorkerMetrics
from worker.models.config import DTYPES, ModelConfigError
from worker.parallel.distributed import GroupError, TPGroup, parse_init_method
from worker.parallel.rank_group import (
    LocalRanks,
    rank_device,
    run_rank,
    threads_per_rank,
)
from worker.process import WorkerProcess, WorkerStopping
from worker.sampling_state import check_global_seed
from worker.serving_model import check_shardable, load_serving_model
from worker.threads import lower_cpu_priority, set_cpu_threads

log = logging.getLogger("worker")


def _size(text: str) -> int:
    if text.strip().startswith("-"):
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: a memory size cannot be negative")
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid fraction {text!r}: expected a number in (0, 1]") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"invalid fraction {text!r}: expected a number in (0, 1]")
    return value


def _seed(text: str) -> int:
    try:
        return check_global_seed(int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid seed {text!r}: expected an integer in 0..2**64-1") from None


def _gib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: expected a number of GiB, e.g. 4 or 0.5") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: expected a number of GiB >= 0")
    return value


# A value that starts like a negative number ("-4MiB", "-.5G"): argparse would take
# it for an option and say only "expected one argument".
_NEGATIVE_VALUE = re.compile(r"^-\.?\d")


def _join_negative_values(argv: list[str]) -> list[str]:
    """``--flag -4MiB`` as ``--flag=-4MiB``, so the flag's own check names the problem."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and _NEGATIVE_VALUE.match(arg):
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def _check_endpoint(endpoint: str) -> str | None:
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


def build_parser() -> argparse.ArgumentParser:
    d = WorkerConfig()
    p = argparse.ArgumentParser(prog="kvpool-worker", description="kvpool worker: owns the KV memory, executes the scheduler's step plans.")
    p.add_argument("--scheduler", default=d.scheduler, metavar="ENDPOINT",
                   help="the scheduler's worker port, a ZeroMQ endpoint (default %(default)s)")
    p.add_argument("--model", metavar="DIR", default=None,
                   help="a Hugging Face checkpoint directory (config.json, *.safetensors) (default: the tiny generated Llama)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="where the model and KV cache live (default: cuda if available, else cpu)")
    p.add_argument("--dtype", choices=["auto", *DTYPES], default=d.dtype,
                   help="model and KV cache dtype; auto: the checkpoint's torch_dtype (default %(default)s)")
    p.add_argument("--max-model-len", type=int, default=None, help="longest context served (default: the model's max_position_embeddings)")
    p.add_argument("--kv-cache-memory", type=_size, default=None, metavar="SIZE",
                   help=f"KV cache budget, e.g. 512MiB, 2GiB, 64M; at most what the device has available "
                        f"(default: on CPU {CPU_DEFAULT_KV_CACHE_MEMORY // 2**20}MiB, on CUDA see --gpu-memory-utilization)")
    p.add_argument("--gpu-memory-utilization", type=_fraction, default=d.gpu_memory_utilization,
                   help="on CUDA without --kv-cache-memory: share of device memory this process may use, weights and "
                        "the profiled activation peak included (default %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="on CUDA: tokens of the dummy forward that profiles the activation peak (default %(default)s)")
    p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block (default %(default)s)")
    p.add_argument("--kv-offloading-size", type=_gib, default=d.kv_offloading_size, metavar="GIB",
                   help="GiB of host memory for the offload tier of KV blocks, as vLLM's flag; allocated (pinned on CUDA) "
                        "before hello; 0: no host tier (default %(default)s)")
    p.add_argument("--seed", type=_seed, default=d.seed,
                   help="global sampling seed: requests without a seed of their own draw from it, so they repeat "
                        "across runs given the same requests in the same order (default %(default)s, as vLLM)")
    p.add_argument("--http-port", type=int, default=d.http_port, help="/metrics and /health on 127.0.0.1 (default %(default)s; 0 disables)")
    p.add_argument("--log-level", default=d.log_level, choices=["DEBUG", "INFO", "WARNING", "ERROR"], type=str.upper,
                   help="log verbosity (default %(default)s)")
    p.add_argument("--scheduler-timeout", type=float, default=d.scheduler_timeout_s, metavar="SECONDS",
                   help="exit 3 (or reconnect) after this long without a message from the scheduler, or without "
                        "WorkerReady after hello; the scheduler's --worker-timeout is the same (default %(default)s)")
    p.add_argument("--reconnect", action="store_true",
                   help="on scheduler timeout, drop every row and handshake again instead of exiting (default: off)")
    p.add_argument("--curve-client-key", metavar="FILE", help="CURVE: this worker's secret certificate (NAME.key_secret) (default: no CURVE)")
    p.add_argument("--curve-server-key", metavar="FILE", help="CURVE: the scheduler's public certificate (NAME.key) (default: no CURVE)")
    p.add_argument("--tensor-parallel-size", type=int, default=d.tensor_parallel_size, metavar="N",
                   help="ranks of one torch.distributed group (gloo on CPU, NCCL on CUDA), each holding 1/N of the heads and "
                        "MLP; without --rank this process is rank 0 and starts the others on this host (default %(default)s)")
    p.add_argument("--rank", type=int, default=None,
                   help="this process's rank, when each rank is started by hand (several hosts; needs --distributed-init-method) "
                        "(default: rank 0, starting the others on this host)")
    p.add_argument("--distributed-init-method", default=None, metavar="tcp://HOST:PORT",
                   help="rank 0's address for the group's TCP store (default: a free loopback port)")
    p.add_argument("--distributed-timeout", type=float, default=d.distributed_timeout_s, metavar="SECONDS",
                   help="how long a collective or the start-up rendezvous waits for another rank (default %(default)s)")
    p.add_argument("--cpu-nice", type=int, default=d.cpu_nice, metavar="N",
                   help="on CPU, run the worker at nice N at least, so that the scheduler and frontend sharing its cores "
                        "are not kept waiting by its compute threads (default %(default)s; 0: the priority it was started with)")
    return p


def config_from_args(argv: list[str] | None = None) -> WorkerConfig:
    p = build_parser()
    a = p.parse_args(_join_negative_values(sys.argv[1:] if argv is None else list(argv)))
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available (torch.cuda.is_available() is False)")
    if a.block_size < 1:
        p.error(f"--block-size must be positive, got {a.block_size}")
    if not 0 <= a.http_port < 65536:
        p.error(f"--http-port must be 0..65535, got {a.http_port}")
    if (why := _check_endpoint(a.scheduler)) is not None:
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
    if a.max_model_len is not None and a.max_model_len < 1:
        p.error(f"--max-model-len must be positive, got {a.max_model_len}")
    if a.max_num_batched_tokens < 1:
        p.error(f"--max-num-batched-tokens must be positive, got {a.max_num_batched_tokens}")
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
    if not 0 <= a.cpu_nice <= 19:
        p.error(f"--cpu-nice must be 0..19 (a nice value; lowering the priority needs no privilege), got {a.cpu_nice}")
    if a.distributed_timeout <= 0:
        p.error(f"--distributed-timeout must be positive, got {a.distributed_timeout}")
    if a.tensor_parallel_size > 1 and a.distributed_timeout <= a.scheduler_timeout:
        # NOTE: while rank 0 waits for WorkerReady it broadcasts nothing.
        p.error(f"--distributed-timeout {a.distributed_timeout:g} must be longer than --scheduler-timeout "
                f"{a.scheduler_timeout:g}: the other ranks wait that long for rank 0's handshake")
    return WorkerConfig(
        scheduler=a.scheduler, model=a.model, device=device, dtype=a.dtype, max_model_len=a.max_model_len,
        kv_cache_memory=a.kv_cache_memory, gpu_memory_utilization=a.gpu_memory_utilization,
        max_num_batched_tokens=a.max_num_batched_tokens, block_size=a.block_size, kv_offloading_size=a.kv_offloading_size, seed=a.seed, http_port=a.http_port,
        log_level=a.log_level, scheduler_timeout_s=a.scheduler_timeout, reconnect=a.reconnect,
        curve_client_key=a.curve_client_key, curve_server_key=a.curve_server_key,
        tensor_parallel_size=a.tensor_parallel_size, rank=a.rank, distributed_init_method=a.distributed_init_method,
        distributed_timeout_s=a.distributed_timeout, cpu_nice=a.cpu_nice,
    )

def _on_sigterm(_signum, _frame) -> None:
    raise WorkerStopping()


def main(argv: list[str] | None = None) -> int:
    config = config_from_args(argv)
    logging.basicConfig(level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if config.device == "cpu":
        nice = lower_cpu_priority(config.cpu_nice)
        log.info("torch uses %d CPU thread(s), at nice %d", set_cpu_threads(), nice)
    group = local_ranks = None
    try:
        if config.tensor_parallel_size > 1:
            if config.rank is None:
                check_shardable(config.model, config.tensor_parallel_size)
            group, local_ranks = start_group(config, sys.argv[1:] if argv is None else list(argv))
        device = config.device if group is None else str(group.device)
        serving = load_serving_model(config.model, config.dtype, device, config.max_model_len, group, config.block_size)
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


def _serve(config: WorkerConfig, serving, group: TPGroup | None) -> int:
    m, model = serving.config, serving.model
    log.info("%s from %s: %s, %s on %s, loaded in %.2f s", m.architecture, serving.directory, serving.identity,
             serving.dtype, model.device, serving.load_seconds)
    if config.kv_cache_memory is not None:
        budget = config.kv_cache_memory
    elif config.device == "cuda":
        from worker.profile import profile_activation_peak

        peak = profile_activation_peak(model, config.max_num_batched_tokens)
        budget = cuda_kv_budget(model.device, config.gpu_memory_utilization, peak)
        log.info("activation peak of a %d-token forward: %d bytes", config.max_num_batched_tokens, peak)
    else:
        budget = CPU_DEFAULT_KV_CACHE_MEMORY
    # NOTE: under tensor parallelism this rank's KV heads only; the pool is the smallest count over ranks.
    per_block = kv_bytes_per_block(m.num_layers, config.block_size, model.num_kv_heads, m.head_dim, DTYPES[serving.dtype])
    num_blocks = num_blocks_for_budget(budget, per_block)
    if group is not None:
        num_blocks = group.min_over_ranks("num_blocks", num_blocks)
    if num_blocks < 2:
        log.error("a KV budget of %d bytes holds %d blocks of %d bytes; at least 2 are needed", budget, num_blocks, per_block)
        return 2
    log.info("device %s, dtype %s: %d KV blocks of %d bytes fit a budget of %d bytes", model.device, serving.dtype, num_blocks, per_block, budget)
    try:
        check_kv_budget(num_blocks * per_block, model.device)
        kv_caches = allocate_kv_caches(m.num_layers, num_blocks, config.block_size, model.num_kv_heads, m.head_dim, DTYPES[serving.dtype], model.device)
    except (ValueError, RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
        log.error("cannot allocate the KV cache (%d blocks of %d bytes): %s", num_blocks, per_block, e)
        return 2
    host_caches = None
    if config.kv_offloading_size > 0:
        num_host = int(config.kv_offloading_size * 2**30) // per_block
        if group is not None:
            num_host = group.min_over_ranks("num_host_blocks", num_host)
        if num_host < 1:
            log.error("--kv-offloading-size %g GiB holds no KV block of %d bytes", config.kv_offloading_size, per_block)
            return 2
        try:
            check_host_tier_budget(num_host * per_block)
            host_caches = allocate_host_kv_caches(kv_caches, num_host)
        except (ValueError, RuntimeError, MemoryError) as e:
            log.error("cannot allocate the host KV tier (%d blocks of %d bytes): %s", num_host, per_block, e)
            return 2
        log.info("host KV tier: %d blocks of %d bytes (%g GiB)%s", num_host, per_block, config.kv_offloading_size,
                 ", pinned" if host_caches[0].is_pinned() else "")
    metrics = None
    if config.http_port and (group is None or group.rank == 0):
        metrics = WorkerMetrics()
        try:
            metrics.serve(config.http_port)
        except OSError as e:
            log.error("cannot serve /metrics on 127.0.0.1:%d: %s (choose another --http-port, or 0 to disable)", config.http_port, e)
            return 2
    ctx = zmq.Context()
    try:
        # NOTE: only now, with a scheduler to tell; before, SIGTERM simply ends the process.
        signal.signal(signal.SIGTERM, _on_sigterm)
        if group is not None:
            return run_rank(config, serving, kv_caches, metrics, group, ctx, host_caches)
        return WorkerProcess(config, serving, kv_caches, metrics, host_caches).run(ctx)
    except WorkerStopping:
        return 0
    except KeyboardInterrupt:
        return 130
    finally:
        ctx.destroy(linger=0)


if __name__ == "__main__":
    sys.exit(main())
