"""`python -m loadgen` / `kvpool-loadgen`: drive the scheduler and report, like `vllm bench serve`.

Exit status: 0 when every request completed; 1 when any failed or the run hit
`--timeout`; 2 on bad arguments or an unreadable or empty dataset; 3 when the
scheduler cannot be reached. The command line is `loadgen/config.py`.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import sys

import numpy as np

from loadgen.arrivals import arrival_offsets
from loadgen.config import LoadgenConfig, describe_workload, make_output_folders, parse_config
from loadgen.datasets import (
    SampleRequest,
    load_mooncake_trace,
    mooncake_requests,
    random_requests,
    shared_prefix_requests,
)
from loadgen.multiturn import Chats, send_chats, sharegpt_chats
from loadgen.progress import Progress
from loadgen.report import format_report, summarize, write_result_json
from loadgen.request_result import SchedulerUnreachable
from loadgen.runner import run_benchmark
from loadgen.sharegpt import read_sharegpt, sharegpt_requests
from protocol.curve import CurveKeyError

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3


def build_dataset(cfg: LoadgenConfig) -> list[SampleRequest] | Chats:
    if cfg.dataset == "multiturn":
        return sharegpt_chats(read_sharegpt(cfg.dataset_path), cfg.num_users, cfg.num_rounds, cfg.system_prompt_words,
                              cfg.question_words, cfg.seed)
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
    if cfg.dataset == "sharegpt":
        from frontend.text.tokenizer import Tokenizer

        encode = Tokenizer(cfg.tokenizer).encode
        return sharegpt_requests(read_sharegpt(cfg.dataset_path), encode, cfg.num_requests, cfg.seed, cfg.sharegpt_output_len)
    records = load_mooncake_trace(cfg.trace)
    # NOTE: a trace brings its own arrival times (× --time-scale); --request-rate and
    # --burstiness apply to the synthetic sets only. --num-requests N keeps the first N.
    return mooncake_requests(
        records, cfg.vocab_size, cfg.time_scale, cfg.max_input_len, cfg.num_requests
    )


def workload_size(requests: list[SampleRequest] | Chats) -> int:
    return requests.num_requests if isinstance(requests, Chats) else len(requests)


def http_client(cfg: LoadgenConfig):
    from loadgen.openai_client import OpenAIClient

    tokenizer = None
    if cfg.tokenizer:
        from frontend.text.tokenizer import Tokenizer

        tokenizer = Tokenizer(cfg.tokenizer)
    return OpenAIClient(cfg.base_url, cfg.endpoint, cfg.model, cfg.backend == "openai-chat", tokenizer,
                        decode_prompts=cfg.dataset != "multiturn")


async def _amain(cfg: LoadgenConfig, requests: list[SampleRequest] | Chats) -> int:
    prefix = f"loadgen-{secrets.token_hex(4)}"
    progress = Progress(workload_size(requests))
    send = None
    if isinstance(requests, Chats):
        chats, requests = requests, []

        def send(client):
            return send_chats(client, chats, cfg.output_len, not cfg.respect_eos, cfg.request_timeout, cfg.timeout, prefix, progress)

    if cfg.dataset == "mooncake":
        offsets = np.array([r.arrival_s for r in requests], dtype=np.float64)
        offsets = np.maximum(offsets - offsets.min(), 0.0) if len(offsets) else offsets
    else:
        offsets = arrival_offsets(len(requests), cfg.request_rate, cfg.burstiness, cfg.seed)
    client = None if cfg.backend == "kvpool" else http_client(cfg)
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
        request_id_prefix=prefix,
        progress=progress,
        client=client,
        send=send,
    )
    series = [s for s in (outcome.before, *outcome.series) if s is not None]
    summary = summarize(outcome.results, outcome.duration_s, outcome.before, outcome.after, series)
    summary["workload"] = describe_workload(cfg, len(outcome.results))
    if client is not None and client.model:
        summary["workload"] += f", model {client.model}"  # as the server's /v1/models names it
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
    if not workload_size(requests):
        print(f"loadgen: error: the {cfg.dataset} dataset has no requests (is the trace {cfg.trace} empty?)", file=sys.stderr)
        return EXIT_USAGE
    make_output_folders(cfg)
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
