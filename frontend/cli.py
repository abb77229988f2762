"""The ``kvpool`` command. ``kvpool serve MODEL`` starts the scheduler, a worker and
the OpenAI-compatible frontend (``frontend.launcher``), with ``vllm serve``'s flags."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from frontend.config import FrontendConfig

MAX_REQUEST_BODY_BYTES = FrontendConfig.__dataclass_fields__["max_request_body_bytes"].default


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < 2**64:
        raise argparse.ArgumentTypeError(f"invalid seed {text!r}: expected an integer in 0..2**64-1")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpool", description="kvpool: vLLM v1's KV-cache manager as a service.")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve a checkpoint with vLLM's OpenAI-compatible API",
                       description="Serve MODEL (a Hugging Face checkpoint folder) on vLLM's OpenAI-compatible API.")  # fmt: skip
    s.add_argument("model", metavar="MODEL", help="checkpoint folder (config.json, safetensors, tokenizer files)")
    s.add_argument("--host", default="127.0.0.1", help="the API's address (default %(default)s)")
    s.add_argument("--port", type=int, default=8000, help="the API's port (default %(default)s)")
    s.add_argument("--served-model-name", default=None, help="the model's name in the API (default: MODEL as given)")
    s.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    s.add_argument("--block-size", type=int, default=16)
    s.add_argument("--num-gpu-blocks-override", type=int, default=None)
    s.add_argument("--max-num-seqs", type=int, default=256)
    s.add_argument("--max-num-batched-tokens", type=int, default=2048)
    s.add_argument("--max-model-len", type=int, default=None, help="default: the model's max_position_embeddings, at most 4096")
    s.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    s.add_argument("--scheduler-reserve-full-isl", action=argparse.BooleanOptionalAction, default=True,
                   help="admit a request only if its whole prompt fits the free blocks, not only its first chunk (default: on, as vLLM)")
    s.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    s.add_argument("--kv-offloading-size", type=float, default=0.0, metavar="GIB",
                   help="GiB of host memory for evicted KV blocks, loaded back on a prefix hit (vLLM's flag; "
                        "given to the worker, which allocates it, and the scheduler, which manages it; default: off)")  # fmt: skip
    s.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="worker ranks in one torch.distributed group, each with 1/N of the heads (default %(default)s)")
    s.add_argument("--seed", type=_seed, default=0,
                   help="global sampling seed of requests without their own (default %(default)s, as vLLM v1)")
    s.add_argument("--generation-config", default="auto", help='"auto" (the model\'s generation_config.json), "vllm" or a folder')
    s.add_argument("--return-tokens-as-token-ids", action="store_true")
    g = s.add_argument_group("kvpool's own")
    g.add_argument("--kv-cache-memory", default=None, metavar="SIZE", help="the worker's KV budget, e.g. 8MiB (default: the worker's)")
    g.add_argument("--device", choices=["cpu", "cuda"], default=None)
    g.add_argument("--worker-http-port", type=int, default=None, metavar="PORT",
                   help="the worker's /metrics on 127.0.0.1 (default: a free port; 0 disables)")  # fmt: skip
    g.add_argument("--dev-mode", action="store_true", help="POST /reset_prefix_cache")
    s.add_argument("--disable-log-stats", action="store_true", help="no periodic stats line in the scheduler's log (default: every 10 s)")
    s.add_argument("--enable-log-requests", action="store_true", help="the API logs each request received (default off)")
    g.add_argument("--max-request-body-bytes", type=int, default=MAX_REQUEST_BODY_BYTES, metavar="BYTES",
                   help="the API refuses a larger request body with 413, before reading it (default %(default)s)")
    g.add_argument("--kv-cache-metrics", action="store_true", help="KV residency histograms")
    g.add_argument("--kv-events-endpoint", default=None, metavar="ENDPOINT")
    g.add_argument("--kv-events-replay-endpoint", default=None, metavar="ENDPOINT")
    g.add_argument("--kv-events-topic", default="", metavar="TOPIC", help="topic frame of every KV event batch (default: empty)")
    g.add_argument("--data-parallel-rank", type=int, default=0, metavar="RANK",
                   help="this replica's rank in its KV events, for an indexer over several replicas (default %(default)s)")  # fmt: skip
    g.add_argument("--scheduler-args", type=shlex.split, default=[], metavar="'ARGS'", help="more flags for the scheduler")
    g.add_argument("--worker-args", type=shlex.split, default=[], metavar="'ARGS'", help="more flags for the worker (CURVE keys...)")
    g.add_argument("--worker-restarts", type=int, default=5,
                   help="exits in a row of a crashed worker before giving up; 60 s of serving resets the count (default %(default)s)")
    g.add_argument("--worker-restart-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="while the worker restarts, new requests wait in the queue; one that waits longer than this "
                        "for a worker fails with 503 (the scheduler's --worker-reconnect-timeout; default %(default)s)")  # fmt: skip
    g.add_argument("--ready-timeout", type=float, default=120.0, metavar="SECONDS")
    g.add_argument("--stop-timeout", type=float, default=10.0, metavar="SECONDS")
    g.add_argument("--log-dir", default=None, help="write each process's log to DIR/NAME.log (default: this terminal)")
    return p


def max_position_embeddings(model_dir: Path) -> int | None:
    import json

    try:
        return int(json.loads((model_dir / "config.json").read_text())["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    if a.command == "serve":
        from frontend.launcher import main_serve

        a.model_dir = Path(a.model).expanduser().resolve()
        if a.served_model_name is None:
            a.served_model_name = a.model
        if a.max_model_len is None:
            # NOTE: vLLM takes max_position_embeddings whole; here it is capped at 4096,
            # the scheduler's default, so a chat request without max_tokens fits a small pool.
            a.max_model_len = min(max_position_embeddings(a.model_dir) or 4096, 4096)
        for flag in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(a, flag) < 1:
                p.error(f"--{flag.replace('_', '-')} must be positive")
        if a.tensor_parallel_size < 1:
            p.error(f"--tensor-parallel-size must be positive, got {a.tensor_parallel_size}")
        if not 0 <= a.kv_offloading_size < float("inf"):
            p.error(f"--kv-offloading-size must be a number of GiB >= 0, got {a.kv_offloading_size}")
        if not 0 < a.worker_restart_timeout < float("inf"):
            p.error(f"--worker-restart-timeout must be a positive number of seconds, got {a.worker_restart_timeout}")
        if a.max_request_body_bytes < 1:
            p.error(f"--max-request-body-bytes must be positive, got {a.max_request_body_bytes}")
        if a.data_parallel_rank < 0:
            p.error(f"--data-parallel-rank must be non-negative, got {a.data_parallel_rank}")
        return main_serve(a)
    return 2


if __name__ == "__main__":
    sys.exit(main())
