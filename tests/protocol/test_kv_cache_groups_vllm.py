"""protocol.kv_cache_spec's grouping held against vLLM 0.32's own (``-m compare``):
vLLM's ``get_kv_cache_groups`` over FullAttentionSpec / SlidingWindowSpec layers
(tests/protocol/data/vllm_kv_cache_groups.py, run in .venv-vllm) gives the same
groups, in the same order, and its layout the same number of KV tensors per block."""

from __future__ import annotations

import json
import subprocess

import pytest

from protocol.kv_cache_spec import kv_cache_groups, num_kv_tensors

pytestmark = [pytest.mark.compare, pytest.mark.timeout(300)]

GEMMA3 = [512] * 5 + [0]
PATTERNS = {
    "gemma3-6": GEMMA3,
    "gemma3-26": (GEMMA3 * 5)[:26],
    "one-to-one": [0, 8] * 4,
    "sliding-first-1:1": [8, 0] * 3,
    "all-sliding": [8] * 5,
    "all-full": [0] * 4,
    "two-windows": [8, 0, 16] * 2,
    "two-windows-uneven": [8, 8, 0, 16, 16, 16, 0],
    "windows-only": [8, 16] * 2,
    "gpt-oss-like": [128, 0] * 12 + [128],
}


@pytest.fixture(scope="module")
def vllm_groups(real_vllm):
    script = real_vllm / "tests/protocol/data/vllm_kv_cache_groups.py"
    out = subprocess.run(
        [str(real_vllm / ".venv-vllm/bin/python"), str(script), json.dumps(PATTERNS)],
        capture_output=True, text=True, timeout=240, check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def ours(windows: list[int], disable_hybrid: bool) -> dict:
    try:
        groups = kv_cache_groups(windows, disable_hybrid)
    except ValueError:
        return {"error": True}
    return {
        "groups": [[g.layer_ids, g.sliding_window] for g in groups],
        "num_kv_tensors": num_kv_tensors(groups),
    }


@pytest.mark.parametrize("name", PATTERNS)
@pytest.mark.parametrize("disable_hybrid", [False, True])
def test_groups_and_tensors_equal_vllms(vllm_groups, name, disable_hybrid):
    theirs = vllm_groups[name][disable_hybrid]
    if "error" in theirs:
        theirs = {"error": True}  # vLLM refuses it: so must we (the message is ours)
    assert ours(PATTERNS[name], disable_hybrid) == theirs
