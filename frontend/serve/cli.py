"""The ``kvpool`` command. ``kvpool serve MODEL`` starts the scheduler, a worker and
the OpenAI-compatible frontend (``frontend.serve.launcher``), and takes every ``vllm serve``
0.32 flag: each is handled, already kvpool's behaviour, or refused by name with the
reason before anything starts (the table: ``frontend.serve.flags``)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from frontend.serve.config import ServeConfig
from frontend.serve.flags import GROUPS, all_rules
from frontend.serve.flags.config_file import ConfigFileError, with_config_file
from frontend.serve.flags.rules import HANDLED, add_rule, refusal
from frontend.serve.flags.spelling import normalize_flag_names
from frontend.serve.gguf_model import GGUFModelError, gguf_model_dir
from frontend.serve.settle import check_config, settled_values
from protocol.kv_transfer_config import parse_kv_transfer_config
from protocol.serve_flags import kvpool
from protocol.serve_flags.flag import add_flag


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
    for row in kvpool.ROWS:
        add_flag(g, row)
    g.add_argument("--kv-cache-memory", default=None, metavar="SIZE", help="the worker's KV budget, e.g. 8MiB (default: the worker's)")
    g.add_argument("--worker-http-port", type=int, default=None, metavar="PORT",
                   help="the worker's /metrics on 127.0.0.1 (default: a free port; 0 disables)")
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


def refused_flag(a: argparse.Namespace, model_dir: Path, tokenizer: str | None) -> str | None:
    """The one line refusing the first vLLM flag kvpool cannot honour as given, or None."""
    for rule in all_rules():
        if (line := refusal(rule, a)) is not None:
            return line
    if a.served_model_name is not None and len(a.served_model_name) > 1:
        names = " ".join(shlex.quote(n) for n in a.served_model_name)
        return f"kvpool serve: --served-model-name {names}: kvpool serves one model name (several are not supported yet)"
    if tokenizer is not None and Path(tokenizer).expanduser().resolve() != model_dir:
        return (f"kvpool serve: --tokenizer {shlex.quote(tokenizer)}: a tokenizer from another folder than MODEL "
                "is not supported yet (kvpool reads MODEL's tokenizer.json)")
    return None


def _settled_kv_transfer(a: argparse.Namespace) -> str | None:
    """--kv-transfer-config, checked once, here: each child is given the checked config's
    JSON, so all three name the same engine_id (a fresh uuid when the flag names none),
    also across restarts. Refused (one line) when it cannot be served as given."""
    if a.kv_transfer_config is None:
        return None
    try:
        config = parse_kv_transfer_config(a.kv_transfer_config)
    except ValueError as e:
        raise Refused(f"kvpool serve: {e}") from None
    backend = a.kv_offloading_backend
    if backend != "native":
        raise Refused(f"kvpool serve: --kv-transfer-config with --kv-offloading-backend {backend}: not supported together yet "
                      "(the host tier, --kv-offloading-size, is)")
    if a.tensor_parallel_size > 1:
        raise Refused(f"kvpool serve: --kv-transfer-config with --tensor-parallel-size {a.tensor_parallel_size}: not supported "
                      "yet (a P/D engine's blocks are moved by one worker)")
    return config.to_json()


class Refused(Exception):
    """A vLLM flag kvpool cannot honour as given: the one line that says so."""


def parse_serve(argv: list[str]) -> ServeConfig:
    """``kvpool serve ...``'s settled config (argv without ``kvpool``). Raises
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
    model_dir, tokenizer = Path(a.model).expanduser().resolve(), a.tokenizer
    if a.model.endswith(".gguf") and model_dir.is_file():
        # NOTE: a GGUF file becomes a folder every process reads as a checkpoint, its
        # tokenizer from the file or from --tokenizer (then part of the folder).
        try:
            model_dir = gguf_model_dir(model_dir, a.tokenizer)
        except GGUFModelError as e:
            raise Refused(f"kvpool serve: {e}") from None
        tokenizer = None  # NOTE: part of the folder now
    if (line := refused_flag(a, model_dir, tokenizer)) is not None:
        raise Refused(line)
    values = vars(a) | {"kv_transfer_config": _settled_kv_transfer(a)} | settled_values(p.serve_parser, a, model_dir)
    given = {rule.dest: values[rule.dest] for rule in all_rules() if rule.verdict != HANDLED and rule.dest in values}
    config = ServeConfig.from_values(values, given)
    check_config(p.serve_parser, config)
    return config


def main(argv: list[str] | None = None) -> int:
    try:
        a = parse_serve(sys.argv[1:] if argv is None else argv)
    except ConfigFileError as e:
        print(f"kvpool serve: {e}", file=sys.stderr)
        return 2
    except Refused as e:
        print(e, file=sys.stderr)
        return 2
    from frontend.serve.launcher import main_serve

    return main_serve(a)


if __name__ == "__main__":
    sys.exit(main())
