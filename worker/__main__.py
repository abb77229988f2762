"""``python -m worker`` / ``kvpool-worker``: the worker process's entry.

Builds the one frozen WorkerConfig from the command line (a bad flag exits 2 with
argparse's usage and the reason), then hands it to ``worker.startup``, which loads the
checkpoint, sizes and allocates the KV cache and runs the process loop.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys

import torch
import zmq

from protocol.curve import CurveKeyError, load_keypair
from protocol.kv_cache_spec import KV_CACHE_DTYPES
from protocol.kv_transfer_config import KVTransferConfig, parse_kv_transfer_config
from worker.config import CPU_DEFAULT_KV_CACHE_MEMORY, WorkerConfig
from worker.kv.kv_cache import parse_size
from worker.models.config import DTYPES
from worker.parallel.distributed import parse_init_method
from worker.sample.sampling_state import check_global_seed
from worker.startup import run


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


def _kv_transfer_config(text: str) -> KVTransferConfig:
    try:
        return parse_kv_transfer_config(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


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
                   help="model dtype, and the KV cache's with --kv-cache-dtype auto; auto: the checkpoint's torch_dtype (default %(default)s)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=d.kv_cache_dtype,
                   help="KV cache dtype: auto (the model's) or fp8 (= fp8_e4m3), fp8_e5m2, one byte per element, "
                        "scaled per tensor as vLLM (default %(default)s)")
    p.add_argument("--max-model-len", type=int, default=None, help="longest context served (default: the model's max_position_embeddings)")
    p.add_argument("--disable-sliding-window", action=argparse.BooleanOptionalAction, default=d.disable_sliding_window,
                   help="every layer attends to the whole context, and --max-model-len is capped at the model's window, "
                        "as vLLM (default: off)")
    p.add_argument("--disable-hybrid-kv-cache-manager", action=argparse.BooleanOptionalAction, default=d.disable_hybrid_kv_cache_manager,
                   help="one full-attention KV-cache group for a model mixing sliding-window and full layers, as vLLM: no "
                        "block is freed outside a window, but the layers still attend within theirs (default: off)")
    p.add_argument("--kv-cache-memory", type=_size, default=None, metavar="SIZE",
                   help=f"KV cache budget, e.g. 512MiB, 2GiB, 64M; at most what the device has available "
                        f"(default: on CPU {CPU_DEFAULT_KV_CACHE_MEMORY // 2**20}MiB, on CUDA see --gpu-memory-utilization)")
    p.add_argument("--num-gpu-blocks-override", type=int, default=None, metavar="N",
                   help="allocate exactly N KV blocks instead of what the budget holds, as vLLM; refused when the device "
                        "cannot hold them (default: from the budget)")
    p.add_argument("--gpu-memory-utilization", type=_fraction, default=d.gpu_memory_utilization,
                   help="on CUDA without --kv-cache-memory: share of device memory this process may use, weights and "
                        "the profiled activation peak included (default %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="on CUDA: tokens of the dummy step that profiles the activation peak (default %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                   help="on CUDA: rows of the profiled step's logits and sampler pass, the scheduler's --max-num-seqs "
                        "(default %(default)s)")
    p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block (default %(default)s)")
    _add_tier_flags(p, d)
    p.add_argument("--seed", type=_seed, default=d.seed,
                   help="global sampling seed: requests without a seed of their own draw from it, so they repeat "
                        "across runs given the same requests in the same order (default %(default)s, as vLLM)")
    p.add_argument("--http-port", type=int, default=d.http_port, help="/metrics and /health on 127.0.0.1 (default %(default)s; 0 disables)")
    p.add_argument("--served-model-name", default=d.served_model_name,
                   help="the model_name label of every metric, as the scheduler's (default %(default)s)")
    p.add_argument("--log-level", default=d.log_level, choices=["DEBUG", "INFO", "WARNING", "ERROR"], type=str.upper,
                   help="log verbosity (default %(default)s)")
    p.add_argument("--scheduler-timeout", type=float, default=d.scheduler_timeout_s, metavar="SECONDS",
                   help="exit 3 (or reconnect) after this long without a message from the scheduler, or without "
                        "WorkerReady after hello; the scheduler's --worker-timeout is the same (default %(default)s)")
    p.add_argument("--reconnect", action="store_true",
                   help="on scheduler timeout, drop every row and handshake again instead of exiting (default: off)")
    p.add_argument("--curve-client-key", metavar="FILE", help="CURVE: this worker's secret certificate (NAME.key_secret) (default: no CURVE)")
    p.add_argument("--curve-server-key", metavar="FILE", help="CURVE: the scheduler's public certificate (NAME.key) (default: no CURVE)")
    _add_parallel_and_cpu_flags(p, d)
    return p


def _add_tier_flags(p: argparse.ArgumentParser, d: WorkerConfig) -> None:
    """The host tier, the external tier below it, and P/D disaggregation's side channel."""
    p.add_argument("--kv-offloading-size", type=_gib, default=d.kv_offloading_size, metavar="GIB",
                   help="GiB of host memory for the offload tier of KV blocks, as vLLM's flag; allocated (pinned on CUDA) "
                        "before hello; 0: no host tier (default %(default)s)")
    g = p.add_argument_group("external KV tier (worker/external/)")
    g.add_argument("--kv-offloading-backend", choices=("native", "disk", "mooncake"), default="native",
                   help="native: the host tier alone (--kv-offloading-size); disk: blocks saved as files under "
                        "--kv-offloading-path, kept across restarts; mooncake: blocks saved in a Mooncake Store "
                        "(--mooncake-master), shared by every engine using it (default %(default)s)")
    g.add_argument("--kv-offloading-path", metavar="DIR", help="disk: the directory of the saved blocks (default: none)")
    g.add_argument("--kv-offloading-disk-size", type=_gib, default=None, metavar="GIB",
                   help="disk: at most this many GiB in the directory; the least recently used blocks are removed past it (default: none)")
    g.add_argument("--mooncake-master", metavar="HOST:PORT", help="mooncake: the master's RPC address (default: none)")
    g.add_argument("--mooncake-metadata", metavar="URL", help="mooncake: the metadata server (http://HOST:PORT/metadata) (default: none)")
    p.add_argument("--kv-transfer-config", type=_kv_transfer_config, default=None, metavar="JSON",
                   help="P/D disaggregation, vLLM's flag: kv_role kv_producer serves lent blocks on a side channel, "
                        "kv_consumer pulls them, kv_both does either (worker/transfer/) (default: none)")


def _add_parallel_and_cpu_flags(p: argparse.ArgumentParser, d: WorkerConfig) -> None:
    """Tensor parallelism's group, and how the worker shares a CPU host."""
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
    p.add_argument("--cpu-wide-step-tokens", type=int, default=d.cpu_wide_step_tokens, metavar="N",
                   help="on CPU, run a step of at least N tokens on every core, the one left to the scheduler and frontend "
                        "included; not with OMP_NUM_THREADS or tensor parallelism (default: from the model's size, "
                        "128 for a 3M-parameter model, 1 from 32M; 0: never); only while no other process keeps a core "
                        "busy (worker/cpu/host_load.py) and no other kvpool worker runs on the host")
    p.add_argument("--serve-pid", type=int, default=None, metavar="PID",
                   help="the kvpool serve that started this worker (it passes its pid): its CPU use and its other "
                        "children's are the serve's own, not a neighbour's (default: none)")


def _check_external_tier(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
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


def _check_kv_transfer(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """--kv-transfer-config, with what it does not work with yet."""
    if a.kv_transfer_config is None:
        return
    if a.tensor_parallel_size > 1:
        p.error("--kv-transfer-config: not with tensor parallelism yet (each rank holds its own heads)")
    if a.kv_offloading_backend != "native":
        p.error(f"--kv-transfer-config: not with --kv-offloading-backend {a.kv_offloading_backend} yet")


def config_from_args(argv: list[str] | None = None) -> WorkerConfig:
    p = build_parser()
    a = p.parse_args(_join_negative_values(sys.argv[1:] if argv is None else list(argv)))
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available (torch.cuda.is_available() is False)")
    _check_block_size_and_port(p, a)
    _check_scheduler_link(p, a)
    _check_lengths(p, a)
    _check_ranks(p, a, device)
    if not 0 <= a.cpu_nice <= 19:
        p.error(f"--cpu-nice must be 0..19 (a nice value; lowering the priority needs no privilege), got {a.cpu_nice}")
    if a.num_gpu_blocks_override is not None and a.num_gpu_blocks_override < 2:
        p.error(f"--num-gpu-blocks-override must be at least 2 (block 0 is the null block), got {a.num_gpu_blocks_override}")
    if a.cpu_wide_step_tokens is not None and a.cpu_wide_step_tokens < 0:
        p.error(f"--cpu-wide-step-tokens must be >= 0 (0: never), got {a.cpu_wide_step_tokens}")
    _check_distributed_timeout(p, a)
    _check_external_tier(p, a)
    _check_kv_transfer(p, a)
    return WorkerConfig(
        scheduler=a.scheduler, model=a.model, device=device, dtype=a.dtype, kv_cache_dtype=a.kv_cache_dtype, max_model_len=a.max_model_len,
        kv_cache_memory=a.kv_cache_memory, num_gpu_blocks_override=a.num_gpu_blocks_override,
        gpu_memory_utilization=a.gpu_memory_utilization,
        max_num_batched_tokens=a.max_num_batched_tokens, max_num_seqs=a.max_num_seqs, block_size=a.block_size, kv_offloading_size=a.kv_offloading_size, seed=a.seed, http_port=a.http_port,
        served_model_name=a.served_model_name,
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


def _check_block_size_and_port(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    if a.block_size < 1:
        p.error(f"--block-size must be positive, got {a.block_size}")
    if not 0 <= a.http_port < 65536:
        p.error(f"--http-port must be 0..65535, got {a.http_port}")


def _check_scheduler_link(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """--scheduler, --scheduler-timeout and the CURVE certificates."""
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


def _check_lengths(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    if a.max_model_len is not None and a.max_model_len < 1:
        p.error(f"--max-model-len must be positive, got {a.max_model_len}")
    if a.max_num_batched_tokens < 1:
        p.error(f"--max-num-batched-tokens must be positive, got {a.max_num_batched_tokens}")
    if a.max_num_seqs < 1:
        p.error(f"--max-num-seqs must be positive, got {a.max_num_seqs}")


def _check_ranks(p: argparse.ArgumentParser, a: argparse.Namespace, device: str) -> None:
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


def _check_distributed_timeout(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    if a.distributed_timeout <= 0:
        p.error(f"--distributed-timeout must be positive, got {a.distributed_timeout}")
    if a.tensor_parallel_size > 1 and a.distributed_timeout <= a.scheduler_timeout:
        # NOTE: while rank 0 waits for WorkerReady it broadcasts nothing.
        p.error(f"--distributed-timeout {a.distributed_timeout:g} must be longer than --scheduler-timeout "
                f"{a.scheduler_timeout:g}: the other ranks wait that long for rank 0's handshake")


def main(argv: list[str] | None = None) -> int:
    config = config_from_args(argv)
    logging.basicConfig(level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run(config, sys.argv[1:] if argv is None else list(argv))


if __name__ == "__main__":
    sys.exit(main())
