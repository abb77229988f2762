"""The fp8 KV cache's cast and names: vLLM 0.32's meanings (fp8 is E4M3), saturation,
rounding toward zero on CPU as vLLM's CPU kernel (checked against that kernel's bytes
with ``-m compare``), to nearest even on CUDA, and the scales' rule."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from protocol.kv_cache_spec import KV_CACHE_DTYPES, kv_cache_element_size
from worker.attention import fp8_gather
from worker.attention.cache_ops import KVCacheWriter
from worker.attention.kv_quant import (
    KVScales,
    checkpoint_kv_scales,
    dequantize,
    kv_cache_torch_dtype,
    quantize,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def test_names_mean_what_vllm_means():
    assert KV_CACHE_DTYPES == ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
    assert kv_cache_torch_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_torch_dtype("fp8", torch.bfloat16) == E4M3  # vllm/config/cache.py: fp8 (=fp8_e4m3)
    assert kv_cache_torch_dtype("fp8_e4m3", torch.float32) == E4M3
    assert kv_cache_torch_dtype("fp8_e5m2", torch.float32) == E5M2
    with pytest.raises(ValueError, match="'int8' is not supported"):
        kv_cache_torch_dtype("int8", torch.float32)
    assert [kv_cache_element_size(n, 2) for n in KV_CACHE_DTYPES] == [2, 1, 1, 1]
    with pytest.raises(ValueError, match="unknown KV cache dtype 'fp8_inc'"):
        kv_cache_element_size("fp8_inc", 2)


# x, E4M3 byte toward zero, E4M3 byte to nearest even. By hand: E4M3 is s.eeee.mmm, bias 7,
# largest 448 (0x7E); 1.7 lies between 1.625 (0x3D) and 1.75 (0x3E); the smallest
# subnormal is 2^-9 = 0.00195 (0x01), above 0.001.
E4M3_CASES = [(1.7, 0x3D, 0x3E), (-1.7, 0xBD, 0xBE), (500.0, 0x7E, 0x7E), (-1e6, 0xFE, 0xFE), (0.001, 0x00, 0x01), (0.25, 0x28, 0x28), (0.0, 0, 0)]
# E5M2 is s.eeeee.mm, bias 15, largest 57344 (0x7B); 1.7 lies between 1.5 (0x3E) and 1.75 (0x3F).
E5M2_CASES = [(1.7, 0x3E, 0x3F), (7e4, 0x7B, 0x7B), (-1e9, 0xFB, 0xFB)]


@pytest.mark.parametrize("fp8, cases", [(E4M3, E4M3_CASES), (E5M2, E5M2_CASES)])
def test_the_cast_saturates_and_rounds_as_vllms_kernels(fp8, cases):
    x = torch.tensor([c[0] for c in cases])
    assert quantize(x, fp8, 1.0, toward_zero=True).view(torch.uint8).tolist() == [c[1] for c in cases]
    assert quantize(x, fp8, 1.0, toward_zero=False).view(torch.uint8).tolist() == [c[2] for c in cases]
    # x / scale is what is stored.
    assert quantize(x * 4, fp8, 4.0, toward_zero=True).view(torch.uint8).tolist() == [c[1] for c in cases]


def test_the_paged_write_stores_the_quantized_bytes():
    cache = torch.zeros((2, 3, 2, 1, 4), dtype=E4M3)  # (2, blocks, block_size, kvh, hd)
    key = torch.tensor([[[1.7, -1.7, 500.0, 0.001]]], dtype=torch.bfloat16)  # (T=1, kvh, hd)
    value = torch.tensor([[[0.25, 0.0, -1e6, 1.7]]])
    KVCacheWriter(cache, KVScales(1.0, 0.5)).write(key, value, torch.tensor([3]))  # block 1, slot 1
    assert cache[0, 1, 1, 0].view(torch.uint8).tolist() == [0x3D, 0xBD, 0x7E, 0x00]
    # V / 0.5: 0.5 (0x30), 0, -448, 3.4 -> 3.25 toward zero (0x45)
    assert cache[1, 1, 1, 0].view(torch.uint8).tolist() == [0x30, 0x00, 0xFE, 0x45]
    assert cache.view(torch.uint8).sum() == cache[:, 1, 1].view(torch.uint8).sum()  # nothing else written


def test_scales_follow_vllms_rule():
    assert checkpoint_kv_scales(None, None) == KVScales(1.0, 1.0)
    assert checkpoint_kv_scales(0.5, 2.0) == KVScales(0.5, 2.0)
    assert checkpoint_kv_scales(0.5, None) == KVScales(0.5, 0.5)
    assert checkpoint_kv_scales(None, 3.0) == KVScales(3.0, 3.0)


# Runs in vLLM's venv: writes each value through vLLM's CPU cpu_attn_reshape_and_cache and
# prints the bytes. The kernel's block layout is its own, so each (token, dim) is found
# by writing a lone 1.0 there first.
_VLLM_PROBE = r"""
import json, sys, torch, vllm._custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
T, HD = 32, 32
def write(key, name, scale, dt):
    cache = torch.zeros(1, 1, 2 * T, HD, dtype=torch.uint8)
    kc, vc = cache.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key.to(dt), key.to(dt), kc, vc, torch.arange(T), _get_attn_isa(dt, T, HD, name),
                                   k_scale=scale, v_scale=scale, kv_cache_dtype=name)
    return kc.contiguous().reshape(-1)
where = []
for t in range(T):
    for d in range(HD):
        one = torch.zeros(T, 1, HD); one[t, 0, d] = 1.0
        where.append(int(write(one, "fp8", 1.0, torch.float32).nonzero()[0]))
x = torch.tensor(json.loads(sys.argv[1])).reshape(T, 1, HD)
out = {}
for name in ("fp8", "fp8_e4m3", "fp8_e5m2"):
    for dt in ("float32", "bfloat16"):
        for scale in (1.0, 0.37):
            out[f"{name} {dt} {scale}"] = write(x, name, scale, getattr(torch, dt))[where].tolist()
print(json.dumps(out))
"""


@pytest.mark.compare
def test_the_cpu_cast_equals_vllms_cpu_kernel_bytes():
    vllm_python = Path(".venv-vllm/bin/python")
    if not vllm_python.exists():
        pytest.skip("no .venv-vllm")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32 * 32, generator=gen) * torch.logspace(-4, 5, 32 * 32)  # subnormals to saturation
    r = subprocess.run([str(vllm_python), "-c", _VLLM_PROBE, json.dumps(x.tolist())], capture_output=True, text=True, timeout=300,
                       env={"VLLM_TARGET_DEVICE": "cpu", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    for key, vllm_bytes in got.items():
        name, dt, scale = key.split()
        fp8, xd = kv_cache_torch_dtype(name, torch.float32), x.to(getattr(torch, dt))
        ours = quantize(xd, fp8, float(scale), toward_zero=True)
        assert ours.view(torch.uint8).tolist() == vllm_bytes, key
        if (kernel := fp8_gather.load()) is not None:  # the C write (worker/attention/fp8_gather.py)
            cache = torch.zeros(x.shape[0], 1, dtype=torch.uint8)
            kernel.quantize_write(xd.view(-1, 1), torch.arange(x.shape[0]), cache, fp8, float(scale))
            assert cache.view(-1).tolist() == vllm_bytes, f"C write: {key}"


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("compute", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_dequantize_equals_torchs_cast_for_every_finite_byte(fp8, compute):
    raw = torch.arange(256, dtype=torch.uint8)
    finite = torch.isfinite(raw.view(fp8).double())  # E4M3: 2 NaNs; E5M2: 6 NaNs, 2 infinities
    for scale in (1.0, 0.37, 3.5):
        out = dequantize(raw, fp8, torch.empty(256, dtype=compute), scale)
        want = raw.view(fp8).to(compute) * scale
        assert torch.equal(out[finite], want[finite]), scale
        assert torch.equal(out[finite].signbit(), want[finite].signbit())  # -0.0 stays -0.0
