"""One benchmark run: connect, send on schedule, stream, scrape /metrics, stop on time.

Each request is a task that sleeps until its arrival offset, waits for a
concurrency slot (if bounded), and streams its tokens through the shared client.
/metrics is scraped before the first request, every `metrics_interval` seconds in
the background, and after the last. If the run passes `timeout` seconds, every
request still in flight is aborted at the scheduler and counted failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from loadgen.client import KVPoolClient
from loadgen.datasets import SampleRequest
from loadgen.metrics_scraper import MetricsSample, MetricsScraper
from loadgen.progress import Progress
from loadgen.request_result import RequestResult

log = logging.getLogger(__name__)


@dataclass
class RunOutcome:
    results: list[RequestResult]
    duration_s: float
    before: MetricsSample | None = None
    after: MetricsSample | None = None
    series: list[MetricsSample] = field(default_factory=list)
    timed_out: bool = False
    metrics_error: str | None = None


async def run_benchmark(
    requests: Sequence[SampleRequest],
    offsets: np.ndarray,
    *,
    scheduler: str,
    metrics_url: str | None,
    curve_keys: tuple[str, str] | None = None,
    ignore_eos: bool,
    max_concurrency: int | None = None,
    request_timeout: float = 120.0,
    connect_timeout: float = 10.0,
    timeout: float | None = None,
    metrics_interval: float = 0.5,
    request_id_prefix: str = "loadgen",
    progress: Progress | None = None,
    client=None,
    send=None,
) -> RunOutcome:
    """Run the workload; raises SchedulerUnreachable if the scheduler cannot be reached.
    ``client``: another client with KVPoolClient's interface (the HTTP one) instead.
    ``send``: ``await send(client)`` sends the workload instead of ``requests`` on their
    offsets (multi-turn chats, whose rounds wait on their answers)."""
    scraper = MetricsScraper(metrics_url, metrics_interval) if metrics_url else None
    client = client or KVPoolClient(scheduler, curve_keys=curve_keys)
    try:
        await client.connect(connect_timeout)
        before = await scraper.scrape() if scraper else None
        if scraper and before is None:
            log.warning(
                "no metrics from %s (%s); the report omits them", metrics_url, scraper.last_error
            )
        if scraper:
            scraper.start()
        outcome = await send(client) if send is not None else await _send_all(
            client,
            requests,
            offsets,
            ignore_eos,
            max_concurrency,
            request_timeout,
            timeout,
            request_id_prefix,
            progress,
        )
        if scraper:
            await scraper.stop()
            outcome.before = before
            outcome.after = await scraper.scrape()
            outcome.series = list(scraper.series)
            outcome.metrics_error = scraper.last_error if outcome.after is None else None
        return outcome
    finally:
        if progress is not None:
            progress.close()
        if scraper:
            await scraper.close()
        await client.close()


async def _send_all(
    client: KVPoolClient,
    requests: Sequence[SampleRequest],
    offsets: np.ndarray,
    ignore_eos: bool,
    max_concurrency: int | None,
    request_timeout: float,
    timeout: float | None,
    prefix: str,
    progress: Progress | None,
) -> RunOutcome:
    n = len(requests)
    results: list[RequestResult | None] = [None] * n
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    request_ids = [f"{prefix}-{i}" for i in range(n)]
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        delay = t0 + float(offsets[i]) - time.perf_counter()
        if delay > 0:
            # NOTE: a lost scheduler fails every request still to come at once
            # (generate returns the error) instead of one by one on the schedule.
            await client.sleep_unless_lost(delay)
        req = requests[i]
        async with slots:
            results[i] = await client.generate(
                i, request_ids[i], req.prompt_token_ids, req.output_len, ignore_eos, request_timeout
            )
        if progress is not None:
            progress.update(results[i].success)

    tasks = [asyncio.create_task(one(i)) for i in range(n)]
    timed_out = False
    try:
        _, pending = await asyncio.wait(tasks, timeout=timeout) if tasks else (set(), set())
        if pending:
            timed_out = True
            await client.abort()  # free the scheduler's blocks before we forget the ids
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    duration = time.perf_counter() - t0
    for t in tasks:
        if t.done() and not t.cancelled() and t.exception() is not None:
            raise t.exception()
    final: list[RequestResult] = []
    for i, r in enumerate(results):
        if r is None:
            r = RequestResult(
                i,
                request_ids[i],
                requests[i].prompt_len,
                error=f"not finished within --timeout {timeout:g} s",
            )
        final.append(r)
    return RunOutcome(final, duration, timed_out=timed_out)
