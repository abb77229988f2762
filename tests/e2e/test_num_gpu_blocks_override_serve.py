"""`kvpool serve --num-gpu-blocks-override N` serves a pool of exactly N blocks, above
what --kv-cache-memory holds too (vLLM sizes its cache to the override:
kv_cache_utils.may_override_num_blocks); an N the host cannot hold is refused at start,
naming the flag. Every process started here is stopped here."""

from __future__ import annotations

import os
import re
import subprocess
import urllib.request

import pytest
from kvtest.serve import KVPOOL, free_port, kvpool_serve

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# The tiny checkpoint's block at block size 16 in float32: K and V x 4 layers x 16 tokens x 2 KV heads x 32.
BYTES_PER_BLOCK = 2 * 4 * 16 * 2 * 32 * 4
DEFAULT_BUDGET_BLOCKS = 8 * 2**20 // BYTES_PER_BLOCK  # kvpool_serve's --kv-cache-memory 8MiB


def test_an_override_above_the_kv_budget_gives_a_pool_of_exactly_that_many_blocks(tiny_checkpoint, tmp_path):
    n = 3 * DEFAULT_BUDGET_BLOCKS + 5
    with kvpool_serve(tiny_checkpoint, tmp_path, "--num-gpu-blocks-override", str(n), "--dtype", "float32") as s:
        assert f"KV cache: {n} blocks × 16 tokens" in s.ready_line
        page = urllib.request.urlopen(s.base_url + "/metrics", timeout=10).read().decode()
    assert re.search(rf"^kvpool_num_gpu_blocks(\{{[^}}]*\}})? {n}(\.0)?$", page, re.M), page[:2000]
    info = next(line for line in page.splitlines() if line.startswith("vllm:cache_config_info{"))
    assert f'num_gpu_blocks="{n}"' in info and f'num_gpu_blocks_override="{n}"' in info, info


def test_an_override_the_host_cannot_hold_is_refused_naming_the_flag(tiny_checkpoint, tmp_path):
    n = 2 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // BYTES_PER_BLOCK  # twice the host's memory
    argv = [KVPOOL, "serve", str(tiny_checkpoint), "--port", str(free_port()), "--log-dir", str(tmp_path), "--device", "cpu",
            "--dtype", "float32", "--num-gpu-blocks-override", str(n)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=180)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 1, said
    assert "the worker exited during start-up (status 2)" in said and "lower --num-gpu-blocks-override" in said, said
    assert f"cannot allocate the KV cache ({n} blocks of {BYTES_PER_BLOCK} bytes)" in said, said
