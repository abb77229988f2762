"""The load generator's HTTP backends against a live `kvpool serve`: every request
completes, output tokens come from usage (exactly --output-len with ignore_eos), the
shared prefixes show up as cached tokens, and the report says what it ran."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import pytest
from kvtest.serve import kvpool_serve

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def served(tiny_checkpoint, tmp_path_factory):
    # --enable-prompt-tokens-details: usage carries cached_tokens only then, as in vLLM.
    with kvpool_serve(tiny_checkpoint, tmp_path_factory.mktemp("serve-logs"), "--max-model-len", "1024",
                      "--enable-prompt-tokens-details") as s:
        yield s


def prompt_tokens_counted(base_url: str) -> float:
    """The server's vllm:prompt_tokens_total, summed over its label sets."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:prompt_tokens_total{"))


def loadgen(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "loadgen", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_http_backends_complete_every_request(served, tmp_path, backend, tiny_checkpoint):
    result = tmp_path / "r.json"
    # No --metrics-url: the server's /metrics is found from --base-url.
    before = prompt_tokens_counted(served.base_url)
    p = loadgen("--backend", backend, "--base-url", served.base_url,
                "--num-requests", "12", "--num-prefixes", "2", "--prefix-len", "48", "--suffix-len", "8",
                "--output-len", "5", "--max-concurrency", "4", "--result-json", str(result))
    assert p.returncode == 0, p.stdout + p.stderr
    r = json.loads(result.read_text())
    assert r["completed"] == 12 and r["failed"] == 0
    assert r["total_output_tokens"] == 12 * 5  # from usage, ignore_eos
    assert r["ttft_ms"]["median"] > 0 and r["tpot_ms"]["median"] > 0
    # The input tokens are the ones the server counted (a chat prompt is its template's tokens).
    assert r["total_input_tokens"] == prompt_tokens_counted(served.base_url) - before
    assert r["peak_kv_cache_usage"] is not None and 0 < r["peak_kv_cache_usage"] <= 1
    assert 0 <= r["client_cached_token_frac"] <= 1
    assert "Peak KV cache usage:" in p.stdout and "n/a" not in p.stdout.split("Peak KV cache usage:")[1].splitlines()[0]
    if backend == "openai":
        # token-id prompts: the 2 prefixes of 48 tokens (3 blocks) are cached after their first use
        assert r["client_cached_token_frac"] > 0.3
        assert r["prefix_cache_hit_rate"] > 0.3
    endpoint = "/v1/chat/completions" if backend == "openai-chat" else "/v1/completions"
    assert f"via {served.base_url}{endpoint}, model {tiny_checkpoint}" in p.stdout


def test_an_unreachable_server_exits_3(tmp_path):
    from kvtest.serve import free_port

    p = loadgen("--base-url", f"http://127.0.0.1:{free_port()}", "--metrics-url", "", "--num-requests", "1",
                "--connect-timeout", "1")
    assert p.returncode == 3 and "cannot reach the server" in p.stderr
