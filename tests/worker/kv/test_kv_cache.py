"""KV cache sizing, size parsing, and the command line."""

from __future__ import annotations

import pytest
import torch

from worker.__main__ import config_from_args
from worker.kv.kv_cache import (
    allocate_host_kv_caches,
    allocate_kv_caches,
    cuda_kv_budget,
    kv_bytes_per_block,
    num_blocks_for_budget,
    page_locked_zeros,
    parse_size,
)


@pytest.mark.parametrize(
    ("text", "size"),
    [("512MiB", 512 << 20), ("2GiB", 2 << 30), ("64M", 64 << 20), ("64m", 64 << 20), ("1.5G", 3 << 29),
     ("4096", 4096), ("10KB", 10_000), ("1 GiB", 1 << 30), ("3k", 3072)],
)
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "garbage", "-1", "0", "0MiB", "12Q", "1iB", "MiB", "1e3", "5 GiBs", "1.2.3M"])
def test_parse_size_rejects_garbage(text):
    with pytest.raises(ValueError, match="invalid size"):
        parse_size(text)


def test_cli_rejects_bad_kv_cache_memory_with_a_clear_error(capsys):
    with pytest.raises(SystemExit) as e:
        config_from_args(["--kv-cache-memory", "lots"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--kv-cache-memory" in err and "invalid size 'lots'" in err and "512MiB" in err


def test_cli_defaults_and_flags():
    c = config_from_args(["--device", "cpu", "--kv-cache-memory", "1MiB", "--block-size", "8", "--http-port", "0", "--dtype", "float64"])
    assert (c.device, c.dtype, c.kv_cache_memory, c.block_size, c.http_port) == ("cpu", "float64", 1 << 20, 8, 0)
    assert c.model is None and c.max_model_len is None  # the tiny default checkpoint, its own length
    assert c.scheduler == "tcp://127.0.0.1:5556" and c.scheduler_timeout_s == 10.0  # = the scheduler's --worker-timeout
    d = config_from_args(["--model", "/some/dir", "--max-model-len", "2048"])
    assert (d.model, d.max_model_len, d.dtype) == ("/some/dir", 2048, "auto")


def test_cli_rejects_a_dtype_it_does_not_know(capsys):
    with pytest.raises(SystemExit):
        config_from_args(["--dtype", "int8"])
    assert "invalid choice: 'int8'" in capsys.readouterr().err


def test_blocks_for_budget():
    per_block = kv_bytes_per_block(num_layers=2, block_size=16, num_kv_heads=2, head_dim=32, dtype=torch.float32)
    assert per_block == 2 * 2 * 16 * 2 * 32 * 4
    assert num_blocks_for_budget(64 << 20, per_block) == 4096
    assert num_blocks_for_budget(per_block * 3 - 1, per_block) == 2


def test_allocation_layout():
    caches = allocate_kv_caches(3, 10, 4, 2, 8, torch.float16, "cpu")
    assert len(caches) == 3
    assert all(kv.shape == (2, 10, 4, 2, 8) and kv.dtype == torch.float16 for kv in caches)
    assert caches[0].data_ptr() != caches[1].data_ptr()
    with pytest.raises(ValueError, match="at least 2 blocks"):
        allocate_kv_caches(1, 1, 4, 2, 8, torch.float32, "cpu")



GIB = 2**30


def test_the_cuda_budget_counts_what_this_process_took_not_other_processes(monkeypatch):
    """vLLM's count: an 80 GiB device where another engine holds 36 GiB throughout; this one
    loaded 4 GiB of weights (44 free before, 40 after) and profiled a 2 GiB peak."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40 * GIB, 80 * GIB))
    budget = cuda_kv_budget(torch.device("cuda"), 0.45, 2 * GIB, before_load=(44 * GIB, 80 * GIB))
    assert budget == int(80 * GIB * 0.45) - 4 * GIB - 2 * GIB
    # Weights and peak past the share: nothing left, never a negative budget.
    assert cuda_kv_budget(torch.device("cuda"), 0.05, 2 * GIB, before_load=(44 * GIB, 80 * GIB)) == 0


def test_the_cuda_budget_refuses_a_share_the_device_did_not_have_free(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40 * GIB, 80 * GIB))
    with pytest.raises(ValueError, match=r"\(44.00/80.00 GiB\) is less than --gpu-memory-utilization 0.9 asks for \(72.00 GiB\)"):
        cuda_kv_budget(torch.device("cuda"), 0.9, 0, before_load=(44 * GIB, 80 * GIB))


class FakeCudart:
    """torch.cuda.cudart()'s cudaHostRegister, recording what it is asked to register."""

    def __init__(self, rc: int):
        self.rc, self.calls = rc, []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802 - CUDA's name
        self.calls.append((ptr, size, flags))
        return self.rc


def test_the_host_tier_locks_exactly_its_bytes(monkeypatch):
    """Registered byte for byte, where torch's pin_memory would round 2 x 3 x 5 x 7 x 4 bytes
    (and a 2.3 GiB layer) up to the next power of two."""
    cudart = FakeCudart(0)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    t = page_locked_zeros((2, 3, 5, 7), torch.float32)
    assert cudart.calls == [(t.data_ptr(), 2 * 3 * 5 * 7 * 4, 0)]
    assert t.shape == (2, 3, 5, 7) and not t.any()


def test_a_host_tier_that_cannot_be_locked_stays_pageable_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart(2))  # cudaErrorMemoryAllocation
    with caplog.at_level("WARNING"):
        t = page_locked_zeros((4, 8), torch.bfloat16)
    assert t.shape == (4, 8) and "cudaHostRegister of 64 bytes failed" in caplog.text


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_host_tier_is_page_locked_and_copies_asynchronously():
    dev = allocate_kv_caches(2, 8, 4, 2, 16, torch.bfloat16, "cuda")
    host = allocate_host_kv_caches(dev, 5)
    assert all(h.is_pinned() and h.shape == (2, 5, 4, 2, 16) for h in host)
    src = torch.randn(2, 5, 4, 2, 16, device="cuda").to(torch.bfloat16)
    host[0].copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(host[0].cuda(), src)
