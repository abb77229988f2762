"""RMSNorm and SiLU-and-multiply in one pass (``worker.models.norm_act``) against the ops
transformers' Llama runs, written out here in torch: the same numbers in bfloat16 (up to
a rare one-ulp rounding), float32 to its last bits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.models import norm_act
from worker.models.layers import GatedMLP, Linear, rms_norm

KERNEL = norm_act.load()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="norm_act.so not built, or this CPU lacks AVX-512 F/BF16")
DTYPES = [torch.bfloat16, torch.float32]


def llama_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """bfloat16: equal but for rare entries one rounding step apart; float32: a few ulp
    apart at most (the sums in another order can move a whole row's scale by one)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.bfloat16:
        torch.testing.assert_close(got.double(), want.double(), rtol=2**-7, atol=1e-6)
        assert (got == want).double().mean() > 0.99
    else:
        torch.testing.assert_close(got.double(), want.double(), rtol=2**-20, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,d", [(1, 768), (8, 256), (37, 100), (3, 7), (64, 768)])  # the last one on its threads
def test_rms_norm_is_llamas(dtype, rows, d):
    g = torch.Generator().manual_seed(rows * d)
    x = (torch.randn(rows, d, generator=g) * 3).to(dtype)
    w = (torch.rand(d, generator=g) + 0.5).to(dtype)
    close(KERNEL.rms_norm(x, w, 1e-6), llama_rms_norm(x, w, 1e-6))


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 2048), (8, 300), (5, 13), (16, 2048)])  # the last one on its threads
def test_silu_mul_is_act_gate_times_up(dtype, rows, inter):
    g = torch.Generator().manual_seed(rows + inter)
    gate_up = (torch.randn(rows, 2 * inter, generator=g) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # e^-g past float32's range either way
    gate, up = gate_up.chunk(2, dim=-1)
    close(KERNEL.silu_mul(gate_up), F.silu(gate) * up)


@needs_kernel
def test_rows_a_view_apart_and_an_output_in_place():
    g = torch.Generator().manual_seed(5)
    wide = torch.randn(6, 80, generator=g).to(torch.bfloat16)
    w = torch.rand(64, generator=g).to(torch.bfloat16)
    rows = wide[:, 8:72]  # 64 values a row, rows 80 apart
    assert KERNEL.supports(rows, w)
    close(KERNEL.rms_norm(rows, w, 1e-5), llama_rms_norm(rows, w, 1e-5))
    out = torch.full((6, 40), 7.0, dtype=torch.bfloat16)
    assert KERNEL.silu_mul(wide, out) is out
    close(out, F.silu(wide[:, :40]) * wide[:, 40:])


def test_what_it_does_not_take_runs_as_torch_ops():
    supports = norm_act.NormAct.supports
    x = torch.randn(4, 3, 16)
    assert not supports(x.to(torch.float16)) and not supports(x.double())
    assert not supports(x[:, :2])  # (4, 2, 16) of a (4, 3, 16): rows not evenly apart
    assert not supports(x.transpose(1, 2))  # values not contiguous
    assert not supports(x, torch.randn(16).to(torch.bfloat16))  # weight of another dtype
    assert not supports(x, torch.randn(8))
    # rms_norm takes such a view all the same (torch's ops), with Llama's numbers.
    v, w = x[:, :2], torch.rand(16) + 0.5
    torch.testing.assert_close(rms_norm(v, w, 1e-6), llama_rms_norm(v, w, 1e-6))


@needs_kernel
@pytest.mark.parametrize("rows", [3, 600])  # 600: the MLP in chunks of MLP_CHUNK_ROWS
def test_the_mlp_takes_its_activation_fused(rows, monkeypatch):
    g = torch.Generator().manual_seed(rows)
    h, inter = 64, 96
    mlp = GatedMLP(Linear((torch.randn(2 * inter, h, generator=g) / 8).to(torch.bfloat16)),
                   Linear((torch.randn(h, inter, generator=g) / 10).to(torch.bfloat16)))
    x = torch.randn(rows, h, generator=g).to(torch.bfloat16)
    fused = mlp(x)
    monkeypatch.setattr(norm_act, "load", lambda: None)
    assert torch.equal(fused, mlp(x))  # torch's silu and multiply: the same bits here


def torch_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """rope.apply_rope's torch ops, written out: each half times cos, then the other half times sin added in."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat(((x1 * cos).addcmul_(x2, sin, value=-1), (x2 * cos).addcmul_(x1, sin)), dim=-1)


@needs_kernel
@pytest.mark.parametrize("rows,hd", [(1, 64), (8, 64), (5, 40), (300, 128)])  # 300 x 12 x 128: on its threads
def test_rope_rounds_as_the_torch_ops_bit_for_bit_on_a_view_of_qkv(rows, hd):
    from worker.models.rope import apply_rope

    g = torch.Generator().manual_seed(rows + hd)
    nh, kvh = 9, 3
    qkv = (torch.randn(rows, (nh + 2 * kvh) * hd, generator=g) * 4).to(torch.bfloat16)
    qk = qkv[:, : (nh + kvh) * hd].view(rows, nh + kvh, hd)  # q and k heads, rows (nh + 2 kvh) hd apart
    angles = torch.rand(rows, 1, hd // 2, generator=g) * 50
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    assert KERNEL.supports_rope(qk, cos, sin)
    want = torch_rope(qk, cos, sin)
    got = KERNEL.rope(qk, cos, sin)
    assert got.is_contiguous() and torch.equal(got, want)
    assert torch.equal(apply_rope(qk, cos, sin), want)


def test_rope_the_kernel_does_not_take_runs_as_torch_ops():
    from worker.models.rope import apply_rope

    supports = norm_act.NormAct.supports_rope
    x = torch.randn(4, 3, 16)
    cos, sin = torch.rand(4, 1, 8), torch.rand(4, 1, 8)
    assert not supports(x, cos, sin)  # float32: torch's ops
    xb, cb, sb = x.to(torch.bfloat16), cos.to(torch.bfloat16), sin.to(torch.bfloat16)
    assert not supports(xb.transpose(0, 1), cb, sb)  # heads not contiguous
    assert not supports(xb, cb[:, :, :4], sb[:, :, :4])  # cos of another shape
    torch.testing.assert_close(apply_rope(x, cos, sin), torch_rope(x, cos, sin))
