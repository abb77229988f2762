"""The projections' packed CPU GEMM (``worker.models.packed_gemm``): the exact product of
the operands up to float32 summation and, for bfloat16, one rounding of the output; the
packing undone exactly; the model's projections on it where it runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from worker.models import packed_gemm
from worker.models.layers import make_linear

KERNEL = packed_gemm.load()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="packed_gemm.so not built, or this CPU lacks AVX-512 F/BF16")


def _operands(n: int, k: int, m: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    x = torch.randn(m, k, generator=g).to(dtype)
    return w, b, x


def _exact(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().T
    return y if b is None else y + b.double()


@needs_kernel
@pytest.mark.parametrize("m", [1, 3, 8, 9, 17, 64])
@pytest.mark.parametrize("n,k", [(32, 2), (96, 40), (1280, 768)])
@pytest.mark.parametrize("bias", [False, True])
def test_a_bf16_product_is_the_exact_one_rounded_once(m, n, k, bias):
    w, b, x = _operands(n, k, m, torch.bfloat16, seed=m * 1000 + n)
    b = b if bias else None
    y = KERNEL(x, KERNEL.pack(w), b)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    exact = _exact(x, w, b)
    # bf16 operands, float32 sums (relative error ~k * 2^-24), one rounding to bf16: within
    # one bf16 step (2^-8 relative) of the exact product rounded to bf16.
    want = exact.to(torch.bfloat16).double()
    assert torch.allclose(y.double(), want, rtol=2**-7, atol=1e-5 * k**0.5)
    # And no further than one rounding of it: most entries are the exact product rounded.
    assert (y.double() == want).float().mean() > 0.9


@needs_kernel
@pytest.mark.parametrize("m", [1, 8, 13, 64])
@pytest.mark.parametrize("n,k", [(32, 1), (64, 75), (768, 2048)])
def test_a_float32_product_is_the_exact_one_to_float32_sums(m, n, k):
    w, b, x = _operands(n, k, m, torch.float32, seed=m + n + k)
    y = KERNEL(x, KERNEL.pack(w), b)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    exact = _exact(x, w, b)
    assert (y.double() - exact).abs().max() <= 1e-6 * k**0.5 * exact.abs().max()


@needs_kernel
def test_rows_of_any_shape_and_stride_in_front():
    w, b, x = _operands(64, 48, 12, torch.bfloat16)
    packed = KERNEL.pack(w)
    y = KERNEL(x, packed, b)
    assert torch.equal(KERNEL(x.view(3, 4, 48), packed, b), y.view(3, 4, 64))
    wide = torch.zeros(12, 100, dtype=torch.bfloat16)
    wide[:, 10:58] = x  # rows 100 apart
    assert torch.equal(KERNEL(wide[:, 10:58], packed, b), y)
    assert KERNEL(x[:0], packed, b).shape == (0, 64)


@needs_kernel
def test_threads_split_the_panels_without_changing_a_bit():
    w, b, x = _operands(1024, 256, 9, torch.bfloat16)
    packed = KERNEL.pack(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = KERNEL(x, packed, b)
        torch.set_num_threads(2)
        two = KERNEL(x, packed, b)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packing_is_undone_exactly(dtype):
    w, _, _ = _operands(96, 10, 1, dtype)
    packed = packed_gemm.PackedGemm.pack(w)
    assert packed.numel() == w.numel() and packed.is_contiguous()
    assert packed_gemm.PackedGemm.shape(packed) == (96, 10)
    assert torch.equal(packed_gemm.PackedGemm.unpack(packed), w)


def test_only_weights_whose_panels_fill_are_packed():
    supports = packed_gemm.PackedGemm.supports
    assert supports(torch.zeros(64, 10)) and supports(torch.zeros(64, 10, dtype=torch.bfloat16))
    assert not supports(torch.zeros(40, 10))  # outputs not a multiple of 32
    assert not supports(torch.zeros(64, 9, dtype=torch.bfloat16))  # bf16 pairs of k
    assert not supports(torch.zeros(64, 10, dtype=torch.float16))
    assert not supports(torch.zeros(64, 10, dtype=torch.float64))
    assert not supports(torch.zeros(64))


@needs_kernel
def test_a_mismatched_input_is_refused_by_name():
    w, _, x = _operands(64, 16, 2, torch.bfloat16)
    packed = KERNEL.pack(w)
    with pytest.raises(ValueError, match="x \\(2, 16\\) torch.float32"):
        KERNEL(x.float(), packed, None)
    with pytest.raises(ValueError, match="against a \\(64, 16\\)"):
        KERNEL(torch.zeros(2, 15, dtype=torch.bfloat16), packed, None)
    with pytest.raises(ValueError, match="bias must be \\(64,\\)"):
        KERNEL(x, packed, torch.zeros(32, dtype=torch.bfloat16))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_make_linear_packs_what_the_kernel_takes_and_leaves_the_rest(dtype):
    w, b, x = _operands(96, 64, 5, dtype)
    lin = make_linear(w, b, dtype)
    assert lin.kernel == "packed" and lin.out_features == 96
    assert torch.equal(lin.dense_weight(), w)
    assert torch.equal(lin(x), KERNEL(x, KERNEL.pack(w), b))
    odd = make_linear(w[:40], b[:40], dtype)  # 40 outputs: no whole panel
    assert odd.kernel != "packed" and odd.out_features == 40


@needs_kernel
def test_an_untied_lm_head_is_held_once_packed(tiny_checkpoint):
    from safetensors.torch import load_file

    from worker.load.checkpoint import Checkpoint
    from worker.models.loader import load_model

    head = load_file(str(tiny_checkpoint / "model.safetensors"))["lm_head.weight"]
    model = load_model(Checkpoint(tiny_checkpoint), torch.bfloat16, "cpu")
    assert model.logits_proj.kernel == "packed"
    assert model.logits_proj.weight.numel() == head.numel()  # the packed copy is the only one
    assert torch.equal(model.lm_head, head.to(torch.bfloat16))


def test_a_library_missing_stale_or_built_for_another_cpu_is_left_for_onednn(tmp_path, caplog):
    import logging
    import shutil

    from worker.cpu import native

    if shutil.which("gcc") is None:
        pytest.skip("no C compiler to build the stand-in libraries")
    source = tmp_path / "fake.c"

    def build(abi: int, available: int) -> Path:
        source.write_text(f"int packed_gemm_abi(void) {{ return {abi}; }}\nint packed_gemm_available(void) {{ return {available}; }}\n"
                          "int packed_gemm(void) { return -2; }\n")
        return native.build(source, ["-shared", "-fPIC"]).rename(tmp_path / f"fake_{abi}_{available}.so")

    with caplog.at_level(logging.DEBUG, logger=native.__name__):
        assert packed_gemm._load(tmp_path / "missing.so") is None
        assert packed_gemm._load(build(packed_gemm.ABI + 1, 1)) is None
        assert packed_gemm._load(build(packed_gemm.ABI, 0)) is None
        assert packed_gemm._load(build(packed_gemm.ABI, 1)) is not None  # current, and its CPU check passes
    text = caplog.text
    assert "not built" in text and "is stale" in text and "needs instructions this CPU lacks" in text
