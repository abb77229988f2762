"""A live ``kvpool serve --kv-cache-dtype fp8``: its pool holds one byte an element
(4x the blocks of float32 in the same --kv-cache-memory), /metrics names the cache dtype
as vLLM's cache_config_info does, and a prompt answered from its cached fp8 blocks gives
the tokens of the same prompt computed (the bytes read back are the bytes written)."""

from __future__ import annotations

import pytest
from kvtest.http_api import PROMPT, get_metrics, metric, post
from kvtest.serve import kvpool_serve

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

# The tiny checkpoint: 4 layers, 2 KV heads, head_dim 32; 16-token blocks of fp8 K and V.
FP8_BLOCK_BYTES = 2 * 4 * 16 * 2 * 32 * 1
BLOCKS = 8 * 2**20 // FP8_BLOCK_BYTES  # the harness's --kv-cache-memory 8MiB


def test_fp8_serve_sizes_reports_and_answers_from_its_cache(tiny_checkpoint, tmp_path):
    assert BLOCKS == 1024
    with kvpool_serve(tiny_checkpoint, tmp_path / "logs", "--dtype", "float32", "--kv-cache-dtype", "fp8") as s:
        assert f"KV cache: {BLOCKS} blocks × 16 tokens, 8" in s.ready_line, s.ready_line
        text = get_metrics(s)
        info = next(line for line in text.splitlines() if line.startswith("vllm:cache_config_info{"))
        assert 'cache_dtype="fp8"' in info and f'num_gpu_blocks="{BLOCKS}"' in info, info
        prompt = PROMPT * 3  # several full blocks
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        status, first = post(s, "/v1/completions", body)
        assert status == 200, first
        status, again = post(s, "/v1/completions", body)
        assert status == 200, again
        hits = metric(get_metrics(s), "vllm:prefix_cache_hits_total")
    assert hits >= 16, "the second request did not read the first one's blocks"
    assert first["usage"]["completion_tokens"] == 12
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
