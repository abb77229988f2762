"""`python -m loadgen` / `kvpool-loadgen`: drive the scheduler and report, like `vllm bench serve`.

Exit status: 0 when every request completed; 1 when any failed or the run hit
`--timeout`; 2 on bad arguments or an unreadable dataset; 3 when the scheduler
cannot be reached.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import secrets
import sys
from dataclasses import dataclass

import numpy as np

from loadgen.arrivals import arrival_offsets
from loadgen.client import SchedulerUnreachable
from loadgen.datasets import (
    DEFAULT_VOCAB_SIZE,
    SampleRequest,
    load_mooncake_trace,
    mooncake_requests,
    random_requests,
    shared_prefix_requests,
)
from loadgen.progress import Progress
from loadgen.report import format_report, summarize, write_result_json
from loadgen.runner import run_benchmark
from protocol.curve import CurveKeyError

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3
DEFAULT_NUM_REQUESTS = 200


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpool-loadgen", description=__doc__.splitlines()[0])
    g = p.add_argument_group("target")
    g.add_argument(
        "--scheduler", default="tcp://127.0.0.1:5555", help="scheduler client port (zmq address)"
    )
    g.add_argument(
        "--metrics-url",
        default="http://127.0.0.1:8000/metrics",
        help="scheduler /metrics; '' to skip",
    )
    g = p.add_argument_group("workload")
    g.add_argument(
        "--dataset", choices=("shared-prefix", "random", "mooncake"), default="shared-prefix"
    )
    g.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="requests to send (default 200; mooncake: all)",
    )
    g.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="req/s (Poisson/gamma); inf = all at once",
    )
    g.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of inter-arrival gaps; 1.0 = Poisson",
    )
    g.add_argument(
        "--max-concurrency", type=int, default=None, help="at most this many requests in flight"
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--vocab-size",
        type=int,
        default=DEFAULT_VOCAB_SIZE,
        help="token ids are drawn from [2, vocab)",
    )
    g.add_argument(
        "--output-len", type=int, default=32, help="tokens to generate (shared-prefix, random)"
    )
    g.add_argument(
        "--respect-eos",
        action="store_true",
        help="stop at EOS (default: ignore_eos, exact output length)",
    )
    g = p.add_argument_group("shared-prefix dataset")
    g.add_argument("--num-prefixes", type=int, default=8)
    g.add_argument("--prefix-len", type=int, default=256)
    g.add_argument("--suffix-len", type=int, default=64)
    g = p.add_argument_group("random dataset")
    g.add_argument("--input-len", type=int, default=256)
    g.add_argument(
        "--range-ratio", type=float, default=0.0, help="lengths uniform in [len*(1-r), len*(1+r)]"
    )
    g = p.add_argument_group("mooncake dataset")
    g.add_argument("--trace", default=None, help="Mooncake JSONL trace")
    g.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="multiplies trace timestamps (0 = all at once)",
    )
    g.add_argument(
        "--max-input-len", type=int, default=None, help="cut longer prompts to this many tokens"
    )
    g = p.add_argument_group("bounds")
    g.add_argument(
        "--request-timeout", type=float, default=120.0, help="a request silent this long fails (s)"
    )
    g.add_argument(
        "--connect-timeout",
        type=float,
        default=10.0,
        help="give up reaching the scheduler after (s)",
    )
    g.add_argument(
        "--timeout", type=float, default=None, help="stop the whole run after this many seconds"
    )
    g = p.add_argument_group("output")
    g.add_argument("--result-json", default=None, help="write the summary (and outputs) here")
    g.add_argument(
        "--save-outputs", action="store_true", help="include every request's token ids in the JSON"
    )
    g.add_argument("--plot", default=None, help="PNG of the scheduler's KV-cache metrics over time")
    g.add_argument(
        "--metrics-interval", type=float, default=0.5, help="seconds between /metrics polls"
    )
    g.add_argument("--log-level", default="WARNING")
    g = p.add_argument_group("security (when the scheduler uses ZeroMQ CURVE)")
    g.add_argument("--curve-client-key", metavar="FILE", help="this client's secret certificate (NAME.key_secret)")
    g.add_argument("--curve-server-key", metavar="FILE", help="the scheduler's public certificate (NAME.key)")
    return p


def parse_config(argv: list[str] | None = None) -> LoadgenConfig:
    p = build_parser()
    a = p.parse_args(argv)
    if a.dataset == "mooncake" and not a.trace:
        p.error("--dataset mooncake needs --trace FILE")
    if a.num_requests is None and a.dataset != "mooncake":
        a.num_requests = DEFAULT_NUM_REQUESTS
    if a.num_requests is not None and a.num_requests < 0:
        p.error("--num-requests must be >= 0")
    for name in ("output_len", "prefix_len", "suffix_len", "input_len", "num_prefixes"):
        if getattr(a, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0")
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
    fields = dict(vars(a))
    fields["metrics_url"] = a.metrics_url or None
    return LoadgenConfig(**fields)


def build_dataset(cfg: LoadgenConfig) -> list[SampleRequest]:
    if cfg.dataset == "shared-prefix":
        return shared_prefix_requests(
            cfg.num_requests,
            cfg.num_prefixes,
            cfg.prefix_len,
            cfg.suffix_len,
            cfg.output_len,
            cfg.vocab_size,
            cfg.seed,
        )
    if cfg.dataset == "random":
        return random_requests(
            cfg.num_requests,
            cfg.input_len,
            cfg.output_len,
            cfg.range_ratio,
            cfg.vocab_size,
            cfg.seed,
        )
    records = load_mooncake_trace(cfg.trace)
    # NOTE: a trace brings its own arrival times (× --time-scale); --request-rate and
    # --burstiness apply to the synthetic sets only. --num-requests N keeps the first N.
    return mooncake_requests(
        records, cfg.vocab_size, cfg.time_scale, cfg.max_input_len, cfg.num_requests
    )


async def _amain(cfg: LoadgenConfig, requests: list[SampleRequest]) -> int:
    if cfg.dataset == "mooncake":
        offsets = np.array([r.arrival_s for r in requests], dtype=np.float64)
        offsets = np.maximum(offsets - offsets.min(), 0.0) if len(offsets) else offsets
    else:
        offsets = arrival_offsets(len(requests), cfg.request_rate, cfg.burstiness, cfg.seed)
    outcome = await run_benchmark(
        requests,
        offsets,
        scheduler=cfg.scheduler,
        curve_keys=(cfg.curve_client_key, cfg.curve_server_key) if cfg.curve_client_key else None,
        metrics_url=cfg.metrics_url,
        ignore_eos=not cfg.respect_eos,
        max_concurrency=cfg.max_concurrency,
        request_timeout=cfg.request_timeout,
        connect_timeout=cfg.connect_timeout,
        timeout=cfg.timeout,
        metrics_interval=cfg.metrics_interval,
        request_id_prefix=f"loadgen-{secrets.token_hex(4)}",
        progress=Progress(len(requests)),
    )
    series = [s for s in (outcome.before, *outcome.series) if s is not None]
    summary = summarize(outcome.results, outcome.duration_s, outcome.before, outcome.after, series)
    print(format_report(summary), flush=True)
    if cfg.metrics_url and outcome.after is None:
        print(
            f"loadgen: warning: no /metrics from {cfg.metrics_url}: {outcome.metrics_error}",
            file=sys.stderr,
        )
    if cfg.result_json:
        write_result_json(cfg.result_json, summary, outcome.results if cfg.save_outputs else None)
    if cfg.plot:
        from loadgen.plot import plot_timeseries  # matplotlib only when asked

        plot_timeseries(series, cfg.plot, title=f"kvpool — {cfg.dataset}")
    if outcome.timed_out:
        print(
            f"loadgen: error: the run did not finish within --timeout {cfg.timeout:g} s",
            file=sys.stderr,
        )
        return EXIT_FAILED
    if summary["failed"]:
        print(
            f"loadgen: error: {summary['failed']} of {len(requests)} requests failed",
            file=sys.stderr,
        )
        return EXIT_FAILED
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(argv)
    logging.basicConfig(
        level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        requests = build_dataset(cfg)
    except (OSError, ValueError) as e:
        print(f"loadgen: error: cannot build the {cfg.dataset} dataset: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:
        runner = asyncio.Runner()
    try:
        with runner:
            return runner.run(_amain(cfg, requests))
    except (SchedulerUnreachable, CurveKeyError) as e:
        print(f"loadgen: error: {e}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except KeyboardInterrupt:
        print("loadgen: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
