"""The line ``kvpool serve`` prints once ready: the model, where it answers, and the KV
pool (blocks × block size, and its bytes). The sizes are the scheduler's, as its worker
reported them (``WorkerHello``), scraped from the scheduler's /metrics; never re-derived
from config.json. A scheduler that does not export the block's bytes gets no size printed.
"""

from __future__ import annotations

import urllib.request

from frontend.serve.config import ServeConfig


def scrape_gauge(url: str, name: str) -> float | None:
    try:
        text = urllib.request.urlopen(url, timeout=2).read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def ready_line(c: ServeConfig, scheduler_http: str, where: str) -> str:
    """The line, for a server answering at ``where`` (its /v1 URL)."""
    metrics = scheduler_http + "/metrics"
    blocks = scrape_gauge(metrics, "kvpool_num_gpu_blocks")
    pool = "KV cache: unknown"
    if blocks is not None:
        per_block = scrape_gauge(metrics, "kvpool_kv_block_bytes")
        tp = c.tensor_parallel_size
        size = f", {human_bytes(blocks * per_block)}" if per_block else ""
        size += f" on each of {tp} ranks" if size and tp > 1 else ""
        pool = f"KV cache: {int(blocks)} blocks × {c.block_size} tokens{size}"
    return f"kvpool serve: {c.served_model_name} ready at {where} ({pool})"
