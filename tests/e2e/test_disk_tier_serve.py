"""A warm restart of the whole service: `kvpool serve --kv-offloading-backend disk`, killed
with SIGKILL (every process of it at once, nothing flushed on the way out), then started
again on the same directory, serves the same prompts from what the first one saved.

Through the OpenAI API (usage.prompt_tokens_details.cached_tokens), as a user would see it.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
import urllib.request

import pytest
from kvtest.serve import kvpool_serve, stop

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

BLOCK = 16
NUM_PROMPTS, PROMPT_TOKENS = 6, 5 * BLOCK + 7


def prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(2, 512) for _ in range(PROMPT_TOKENS)] for _ in range(NUM_PROMPTS)]


def complete(base_url: str, prompt: list[int]) -> dict:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"{base_url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)


def cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def wait_for_files(disk, n: int, timeout: float = 30.0) -> int:
    """The saves run off the step path: wait (bounded) until ``n`` objects are on disk."""
    deadline = time.monotonic() + timeout
    while (count := len(list(disk.rglob("*.kv")))) < n and time.monotonic() < deadline:
        time.sleep(0.1)
    return count


def test_a_killed_serve_restarted_on_its_directory_serves_its_prefixes(tiny_checkpoint, tmp_path):
    disk = tmp_path / "kv"
    args = ("--served-model-name", "tiny", "--enable-prompt-tokens-details", "--num-gpu-blocks-override", "16",
            "--kv-offloading-backend", "disk", "--kv-offloading-path", str(disk), "--kv-offloading-disk-size", "0.05")
    # Full blocks of a prompt a hit may cover (the last prompt token is always computed).
    per_prompt = (PROMPT_TOKENS - 1) // BLOCK * BLOCK
    with kvpool_serve(tiny_checkpoint, tmp_path / "first", *args, new_session=True) as served:
        first = [complete(served.base_url, p) for p in prompts()]
        assert all(cached(r) == 0 for r in first)
        assert wait_for_files(disk, NUM_PROMPTS * per_prompt // BLOCK) == NUM_PROMPTS * per_prompt // BLOCK, served.logs()
        # SIGKILL to the whole service at once: nothing is shut down cleanly.
        os.killpg(served.proc.pid, signal.SIGKILL)
        assert stop(served.proc, timeout=10) == -signal.SIGKILL
    with kvpool_serve(tiny_checkpoint, tmp_path / "second", *args) as served:
        again = [complete(served.base_url, p) for p in prompts()]
        got = [cached(r) for r in again]
        assert got == [per_prompt] * NUM_PROMPTS, served.logs()
        # The same greedy continuations as the first service computed from scratch.
        assert [r["choices"][0]["text"] for r in again] == [r["choices"][0]["text"] for r in first]
