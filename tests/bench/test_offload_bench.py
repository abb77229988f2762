"""The offload benchmark measures what it says: the host-tier step loads the prefix
and samples what the recompute step samples (ttft_ms checks it each round), and the
suite is part of `make bench`."""

from __future__ import annotations

import torch

from bench.__main__ import SUITES
from bench.offload_bench import HOST_PREFIX_BLOCKS, PROMPT_LEN, ttft_ms
from worker.load.checkpoint import Checkpoint
from worker.models.loader import load_model


def test_ttft_rounds_run_and_the_suite_is_registered(tiny_checkpoint):
    assert "offload_bench" in SUITES
    assert HOST_PREFIX_BLOCKS * 16 < PROMPT_LEN  # the host-tier step still prefills a tail
    host_ms, recompute_ms = ttft_ms(load_model(Checkpoint(tiny_checkpoint), torch.float32, "cpu"), rounds=2)
    assert host_ms > 0 and recompute_ms > 0
