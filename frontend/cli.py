"""The ``kvpool`` command. ``kvpool serve MODEL`` starts the scheduler, a worker and
the OpenAI-compatible frontend (``frontend.launcher``), and takes every ``vllm serve``
0.32 flag: each is handled, already kvpool's behaviour, or refused by name with the
reason before anything starts (the table: ``frontend.serve_flags``)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from frontend.config import FrontendConfig
from frontend.gguf_model import GGUFModelError, gguf_model_dir
from frontend.serve_flags import GROUPS, all_rules
from frontend.serve_flags.config_file import ConfigFileError, with_config_file
from frontend.serve_flags.kv_events_config import kv_events_scheduler_flags
from frontend.serve_flags.rules import add_rule, refusal
from frontend.serve_flags.speculative import speculative_scheduler_flags
from frontend.serve_flags.spelling import normalize_flag_names
from frontend.serve_flags.values import DTYPES
from protocol.kv_transfer_config import parse_kv_transfer_config

MAX_REQUEST_BODY_BYTES = FrontendConfig.__dataclass_fields__["max_request_body_bytes"].default


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpool", description="kvpool: vLLM v1's KV-cache manager as a service.")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", usage="kvpool serve [MODEL] [options]", help="serve a checkpoint with vLLM's OpenAI-compatible API",
                       description="Serve MODEL (a Hugging Face checkpoint folder) on vLLM's OpenAI-compatible API, "
                                   "with vllm serve's flags, grouped as vLLM groups them.")
    s.add_argument("model", metavar="MODEL", nargs="?", default=None,
                   help="checkpoint folder (config.json, safetensors, tokenizer files); or --model, or model: in --config")
    for group in GROUPS:
        target = s if group.title == "options" else s.add_argument_group(group.title, group.description)
        for rule in group.rules:
            add_rule(target, rule)
    _add_kvpool_flags(s.add_argument_group("kvpool's own", "Flags vllm serve does not have."))
    p.serve_parser = s  # type: ignore[attr-defined]  # --config reads its option strings
    return p


def _add_kvpool_flags(g) -> None:
    g.add_argument("--kv-cache-memory", default=None, metavar="SIZE", help="the worker's KV budget, e.g. 8MiB (default: the worker's)")
    g.add_argument("--device", choices=["cpu", "cuda"], default=None)
    g.add_argument("--worker-http-port", type=int, default=None, metavar="PORT",
                   help="the worker's /metrics on 127.0.0.1 (default: a free port; 0 disables)")
    g.add_argument("--dev-mode", action="store_true", help="POST /reset_prefix_cache")
    # NOTE: the choices are the scheduler's (scheduler/core/retention/eviction_policies.py), which checks them again.
    g.add_argument("--kv-eviction-policy", choices=("lru", "arc", "lfu", "s3fifo", "cost"), default="lru",
                   help="the device pool's eviction order: lru (vLLM's), arc, lfu, s3fifo, cost (default %(default)s)")
    g.add_argument("--max-pinned-fraction", type=float, default=0.5, metavar="FRACTION",
                   help="share of the KV blocks POST /v1/cache/pin may hold, in [0, 1) (default %(default)s)")
    g.add_argument("--max-request-body-bytes", type=int, default=MAX_REQUEST_BODY_BYTES, metavar="BYTES",
                   help="the API refuses a larger request body with 413, before reading it (default %(default)s)")
    g.add_argument("--kv-events-endpoint", default=None, metavar="ENDPOINT", help="bind a PUB socket here for KV events (loopback)")
    g.add_argument("--kv-events-replay-endpoint", default=None, metavar="ENDPOINT")
    g.add_argument("--kv-events-topic", default="", metavar="TOPIC", help="topic frame of every KV event batch (default: empty)")
    g.add_argument("--cpu-wide-step-tokens", type=int, default=None, metavar="N",
                   help="on CPU, the worker runs a step of at least N tokens on every core while no other process keeps "
                        "one busy (default: the worker's, from the model's size; 0: never)")
    g.add_argument("--cpu-nice", type=int, default=None, metavar="N",
                   help="on CPU, the worker runs at nice N at least, 0..19 (default: the worker's)")
    g.add_argument("--kv-offloading-path", default=None, metavar="DIR",
                   help="--kv-offloading-backend disk: the directory of the saved KV blocks, kept across restarts")
    g.add_argument("--kv-offloading-disk-size", type=float, default=None, metavar="GIB",
                   help="--kv-offloading-backend disk: at most this many GiB in the directory (least recently used removed past it)")
    g.add_argument("--mooncake-master", default=None, metavar="HOST:PORT", help="--kv-offloading-backend mooncake: the store's master")
    g.add_argument("--mooncake-metadata", default=None, metavar="URL",
                   help="--kv-offloading-backend mooncake: the store's metadata server (http://HOST:PORT/metadata)")
    g.add_argument("--scheduler-args", type=shlex.split, default=[], metavar="'ARGS'", help="more flags for the scheduler")
    g.add_argument("--worker-args", type=shlex.split, default=[], metavar="'ARGS'", help="more flags for the worker (CURVE keys...)")
    g.add_argument("--worker-restarts", type=int, default=5,
                   help="exits in a row of a crashed worker before giving up; 60 s of serving resets the count (default %(default)s)")
    g.add_argument("--scheduler-restarts", type=int, default=5,
                   help="exits in a row of a crashed scheduler before giving up; 60 s of serving resets the count (default %(default)s)")
    g.add_argument("--frontend-restarts", type=int, default=5,
                   help="exits in a row of a crashed API server before giving up; 60 s of serving resets the count (default %(default)s)")
    g.add_argument("--worker-restart-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="while the worker or the scheduler restarts, requests wait; one that waits longer than this "
                        "fails with 503 (the scheduler's --worker-reconnect-timeout, the frontend's "
                        "--scheduler-restart-timeout; default %(default)s)")
    g.add_argument("--ready-timeout", type=float, default=120.0, metavar="SECONDS")
    g.add_argument("--stop-timeout", type=float, default=10.0, metavar="SECONDS")
    g.add_argument("--log-dir", default=None, help="write each process's log to DIR/NAME.log (default: this terminal)")


def _config_json(model_dir: Path) -> dict:
    import json

    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def max_position_embeddings(model_dir: Path) -> int | None:
    try:
        return int(_config_json(model_dir)["max_position_embeddings"])
    except (KeyError, TypeError, ValueError):
        return None


def sliding_window(model_dir: Path) -> int | None:
    """The model's attention window, None without one (Qwen2/Qwen3 carry a window that
    is off unless use_sliding_window, as the worker reads it)."""
    config = _config_json(model_dir)
    window = config.get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1 or config.get("use_sliding_window", True) is False:
        return None
    return window


def _max_model_len(p: argparse.ArgumentParser, a: argparse.Namespace) -> int:
    window = sliding_window(a.model_dir) if a.disable_sliding_window else None
    if a.max_model_len is not None:
        if window is not None and a.max_model_len > window:
            p.error(f"--max-model-len {a.max_model_len} is longer than the model's sliding window {window} (--disable-sliding-window)")
        return a.max_model_len
    # NOTE: vLLM takes max_position_embeddings whole; here it is capped at 4096,
    # the scheduler's default, so a chat request without max_tokens fits a small pool.
    return min(max_position_embeddings(a.model_dir) or 4096, 4096, window or 4096)


def refused_flag(a: argparse.Namespace) -> str | None:
    """The one line refusing the first vLLM flag kvpool cannot honour as given, or None."""
    for rule in all_rules():
        if (line := refusal(rule, a)) is not None:
            return line
    if a.served_model_name is not None and len(a.served_model_name) > 1:
        names = " ".join(shlex.quote(n) for n in a.served_model_name)
        return f"kvpool serve: --served-model-name {names}: kvpool serves one model name (several are not supported yet)"
    if a.tokenizer is not None and Path(a.tokenizer).expanduser().resolve() != a.model_dir:
        return (f"kvpool serve: --tokenizer {shlex.quote(a.tokenizer)}: a tokenizer from another folder than MODEL "
                "is not supported yet (kvpool reads MODEL's tokenizer.json)")
    return None


def _settle_kv_transfer(a: argparse.Namespace) -> None:
    """--kv-transfer-config, checked once, here: each child is given the checked config's
    JSON, so all three name the same engine_id (a fresh uuid when the flag names none),
    also across restarts. Refused (one line) when it cannot be served as given."""
    if a.kv_transfer_config is None:
        return
    try:
        config = parse_kv_transfer_config(a.kv_transfer_config)
    except ValueError as e:
        raise Refused(f"kvpool serve: {e}") from None
    backend = a.kv_offloading_backend or "native"
    if backend != "native":
        raise Refused(f"kvpool serve: --kv-transfer-config with --kv-offloading-backend {backend}: not supported together yet "
                      "(the host tier, --kv-offloading-size, is)")
    if a.tensor_parallel_size > 1:
        raise Refused(f"kvpool serve: --kv-transfer-config with --tensor-parallel-size {a.tensor_parallel_size}: not supported "
                      "yet (a P/D engine's blocks are moved by one worker)")
    a.kv_transfer_config = config.to_json()


def _check_external_tier(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """--kv-offloading-backend disk or mooncake and the flags each needs (and no other's)."""
    backend = a.kv_offloading_backend or "native"
    disk_flags, store_flags = (a.kv_offloading_path, a.kv_offloading_disk_size), (a.mooncake_master, a.mooncake_metadata)
    if backend == "disk":
        if not a.kv_offloading_path or not a.kv_offloading_disk_size or a.kv_offloading_disk_size <= 0:
            p.error("--kv-offloading-backend disk needs --kv-offloading-path DIR and --kv-offloading-disk-size GIB (> 0)")
    elif any(v is not None for v in disk_flags):
        p.error(f"--kv-offloading-path and --kv-offloading-disk-size are for --kv-offloading-backend disk, not {backend}")
    if backend == "mooncake":
        if not all(store_flags):
            p.error("--kv-offloading-backend mooncake needs --mooncake-master HOST:PORT and --mooncake-metadata URL")
    elif any(v is not None for v in store_flags):
        p.error(f"--mooncake-master and --mooncake-metadata are for --kv-offloading-backend mooncake, not {backend}")
    if backend != "native" and not a.enable_prefix_caching:
        p.error(f"--kv-offloading-backend {backend} needs the prefix cache: blocks are saved and found by hash")


def settle(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Fill in the defaults that depend on MODEL and check the values (p.error: exit 2)."""
    a.served_model_name = a.served_model_name[0] if a.served_model_name else a.model
    if getattr(a, "enable_auto_tool_choice", False) and not getattr(a, "tool_call_parser", None):
        p.error("--enable-auto-tool-choice requires --tool-call-parser")  # NOTE: vLLM's check, before anything starts
    a.dtype = DTYPES[a.dtype]
    a.max_model_len = _max_model_len(p, a)
    if a.max_num_batched_tokens is None:
        # NOTE: vLLM's default; unchunked, a step must hold a whole prompt.
        chunked = getattr(a, "enable_chunked_prefill", True)
        a.max_num_batched_tokens = 2048 if chunked else max(a.max_model_len, 2048)
    for flag in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "tensor_parallel_size"):
        if getattr(a, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be positive, got {getattr(a, flag)}")
    if not 0 <= a.kv_offloading_size < float("inf"):
        p.error(f"--kv-offloading-size must be a number of GiB >= 0, got {a.kv_offloading_size}")
    _check_external_tier(p, a)
    for name in ("worker_restarts", "scheduler_restarts", "frontend_restarts"):
        if getattr(a, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(a, name)}")
    if not 0 < a.worker_restart_timeout < float("inf"):
        p.error(f"--worker-restart-timeout must be a positive number of seconds, got {a.worker_restart_timeout}")
    if not 0.0 <= a.max_pinned_fraction < 1.0:
        p.error(f"--max-pinned-fraction must be in [0, 1), got {a.max_pinned_fraction}")
    if a.cpu_nice is not None and not 0 <= a.cpu_nice <= 19:
        p.error(f"--cpu-nice must be 0..19 (a nice value; lowering the priority needs no privilege), got {a.cpu_nice}")
    if a.cpu_wide_step_tokens is not None and a.cpu_wide_step_tokens < 0:
        p.error(f"--cpu-wide-step-tokens must be >= 0 (0: never), got {a.cpu_wide_step_tokens}")
    if a.max_request_body_bytes < 1:
        p.error(f"--max-request-body-bytes must be positive, got {a.max_request_body_bytes}")
    if getattr(a, "enable_log_outputs", False) and not a.enable_log_requests:
        p.error("--enable-log-outputs requires --enable-log-requests")  # NOTE: vLLM's check, before anything starts
    if a.kv_cache_memory is not None and a.kv_cache_memory_bytes is not None:
        p.error("--kv-cache-memory-bytes and --kv-cache-memory both size the KV cache: give one")
    if a.kv_cache_memory_bytes is not None and a.kv_cache_memory_bytes < 1:
        p.error(f"--kv-cache-memory-bytes must be positive, got {a.kv_cache_memory_bytes}")
    try:
        a.speculative_flags = speculative_scheduler_flags(a.speculative_config, a.spec_method, a.spec_model, a.spec_tokens)
    except ValueError as e:
        p.error(str(e))
    a.kv_events_flags = []
    if a.kv_events_config is not None:
        if a.kv_events_endpoint is not None:
            p.error("--kv-events-config and --kv-events-endpoint both configure the KV events publisher: give one")
        try:
            a.kv_events_flags = kv_events_scheduler_flags(a.kv_events_config, 0, a.scheduler_args)
        except ValueError as e:
            p.error(str(e))


class Refused(Exception):
    """A vLLM flag kvpool cannot honour as given: the one line that says so."""


def parse_serve(argv: list[str]) -> argparse.Namespace:
    """``kvpool serve ...``'s settled arguments (argv without ``kvpool``). Raises
    ConfigFileError for a bad --config, Refused for a refused flag, and SystemExit(2)
    (argparse's usage and error) for a bad value."""
    p = build_parser()
    argv = with_config_file(normalize_flag_names(list(argv)), p.serve_parser)
    a = p.parse_args(argv)
    if a.command != "serve":
        raise SystemExit(2)
    a.model = a.model or a.model_flag
    if a.model is None:
        p.serve_parser.error("no model: give MODEL, --model MODEL or model: in the --config file")
    a.model_dir = Path(a.model).expanduser().resolve()
    if a.model.endswith(".gguf") and a.model_dir.is_file():
        # NOTE: a GGUF file becomes a folder every process reads as a checkpoint, its
        # tokenizer from the file or from --tokenizer (then part of the folder).
        try:
            a.model_dir = gguf_model_dir(a.model_dir, a.tokenizer)
        except GGUFModelError as e:
            raise Refused(f"kvpool serve: {e}") from None
        a.tokenizer = None
    if (line := refused_flag(a)) is not None:
        raise Refused(line)
    _settle_kv_transfer(a)
    settle(p.serve_parser, a)
    return a


def main(argv: list[str] | None = None) -> int:
    try:
        a = parse_serve(sys.argv[1:] if argv is None else argv)
    except ConfigFileError as e:
        print(f"kvpool serve: {e}", file=sys.stderr)
        return 2
    except Refused as e:
        print(e, file=sys.stderr)
        return 2
    from frontend.launcher import main_serve

    return main_serve(a)


if __name__ == "__main__":
    sys.exit(main())
