"""bench/capacity_bench.py: its theoretical ratio by hand, and a small run where the
hybrid pool, same bytes, runs more requests at once than every layer kept full."""

from __future__ import annotations

import pytest

from bench import capacity_bench as cb


def test_the_theoretical_ratio_is_the_patterns_kv_per_request():
    windows = cb.layer_windows()
    assert (
        windows.count(0) == 4 and windows.count(512) == 22
    )  # Gemma 3 1B: layers 5, 11, 17, 23 full
    # 26 layers x 8192 tokens over 4 x 8192 + 22 x 512.
    assert cb.theoretical_ratio(windows, 8192) == pytest.approx(26 * 8192 / (4 * 8192 + 22 * 512))
    assert cb.theoretical_ratio(windows, 100) == pytest.approx(
        1.0
    )  # shorter than the window: no gain


def test_a_small_run_holds_more_requests_with_hybrid_groups(monkeypatch):
    monkeypatch.setattr(cb, "POOL_BYTES", 256 << 20)
    full = cb.run(True, num_requests=16, prompt_len=2048, output_len=256)
    hybrid = cb.run(False, num_requests=16, prompt_len=2048, output_len=256)
    # A block: 16 tokens x 1024 bytes (K and V, one 256-dim head, bf16) x the layers it spans.
    assert (full["kv_tensors"], hybrid["kv_tensors"]) == (26, 4)
    assert (full["num_blocks"], hybrid["num_blocks"]) == (630, 4096)
    # All full: 2048 + 256 tokens are 144 blocks, 4 of them fit 629. Hybrid: 144 full blocks
    # and 6 sliding groups plateauing near 33 each once prefilled: about 10 fit 4095.
    assert full["peak_decoding"] == 4 and hybrid["peak_decoding"] >= 9
