"""The frontend process's one frozen config, built from the command line
(``python -m frontend``; ``kvpool serve`` passes these for you). Flags as
``vllm serve`` names them where it has them."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from frontend.sampling import DEFAULT_MAX_N_SEQUENCES


@dataclass(frozen=True, slots=True)
class FrontendConfig:
    model: str
    served_model_name: str
    host: str = "127.0.0.1"
    # NOTE: not vLLM's 8000: on their own, the scheduler's HTTP port is 8000 and the
    # worker's 8001 (`kvpool serve` puts the API on 8000 and picks the others free).
    port: int = 8002
    scheduler: str = "tcp://127.0.0.1:5555"
    scheduler_http: str = "http://127.0.0.1:8000"
    max_model_len: int = 4096
    generation_config: str = "auto"
    return_tokens_as_token_ids: bool = False
    dev_mode: bool = False
    # NOTE: aiohttp refuses a larger body with 413 before reading it; 4 MiB is far
    # more text than --max-model-len tokens of any tokenizer.
    max_request_body_bytes: int = 4 << 20
    connect_timeout_s: float = 60.0
    curve_client_key: str | None = None
    curve_server_key: str | None = None
    log_level: str = "INFO"
    enable_log_requests: bool = False
    # vLLM's VLLM_MAX_N_SEQUENCES, read as vLLM reads it: the most choices one request may ask for.
    max_n_sequences: int = DEFAULT_MAX_N_SEQUENCES


def build_parser() -> argparse.ArgumentParser:
    d = FrontendConfig("", "")
    p = argparse.ArgumentParser(prog="kvpool-frontend", description="kvpool's OpenAI-compatible API server (a client of the scheduler).")
    p.add_argument("--model", required=True, help="checkpoint folder (its tokenizer files are read)")
    p.add_argument("--served-model-name", default=None, help="the model's name in the API (default: --model as given)")
    p.add_argument("--host", default=d.host, help="the API's address (default %(default)s)")
    p.add_argument("--port", type=int, default=d.port, help="the API's port (default %(default)s: the scheduler's HTTP port is 8000, the worker's 8001)")
    p.add_argument("--scheduler", default=d.scheduler, help="the scheduler's client port (default %(default)s)")
    p.add_argument("--scheduler-http", default=d.scheduler_http, help="the scheduler's /health and /metrics (default %(default)s)")
    p.add_argument("--max-model-len", type=int, default=d.max_model_len, help="longest prompt + output, in tokens (default %(default)s)")
    p.add_argument("--generation-config", default=d.generation_config, help='"auto" (the model\'s), "vllm" (none) or a folder (default %(default)s)')
    p.add_argument("--return-tokens-as-token-ids", action="store_true", help="logprobs name tokens as token_id:N (default off)")
    p.add_argument("--dev-mode", action="store_true", help="enable POST /reset_prefix_cache (default off)")
    p.add_argument("--max-request-body-bytes", type=int, default=d.max_request_body_bytes, help="larger request bodies get 413 (default %(default)s)")
    p.add_argument("--connect-timeout", dest="connect_timeout_s", type=float, default=d.connect_timeout_s,
                   help="give up reaching the scheduler after this long, in s (default %(default)s)")
    p.add_argument("--curve-client-key", metavar="FILE", help="this client's secret certificate, NAME.key_secret (default: none, no CURVE)")
    p.add_argument("--curve-server-key", metavar="FILE", help="the scheduler's public certificate, NAME.key (default: none, no CURVE)")
    p.add_argument("--enable-log-requests", action="store_true",
                   help="log each request received: its id, sampling parameters and prompt lengths (default off, as vLLM)")
    p.add_argument("--log-level", default=d.log_level, type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="(default %(default)s)")
    return p


def config_from_args(argv: list[str] | None = None) -> FrontendConfig:
    p = build_parser()
    a = p.parse_args(argv)
    if not 0 <= a.port <= 65535:
        p.error(f"--port must be a port number, got {a.port}")
    if a.max_model_len < 2:
        p.error(f"--max-model-len must be at least 2, got {a.max_model_len}")
    if (a.curve_client_key is None) != (a.curve_server_key is None):
        p.error("--curve-client-key and --curve-server-key go together")
    if a.served_model_name is None:
        a.served_model_name = a.model
    raw = os.environ.get("VLLM_MAX_N_SEQUENCES", str(DEFAULT_MAX_N_SEQUENCES))
    if not raw.strip().isdigit() or int(raw) < 1:
        p.error(f"VLLM_MAX_N_SEQUENCES must be a positive integer, got {raw!r}")
    a.max_n_sequences = int(raw)
    return FrontendConfig(**vars(a))
