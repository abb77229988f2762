"""A half-precision model's projections on a CPU without a native bf16 GEMM
(``worker.models.gemm``): float32 weights, outputs rounded to the model's dtype,
the numbers of a bfloat16 GEMM. And the kernels a projection falls back to where the
packed one (``worker.models.packed_gemm``, tests/worker/test_packed_gemm.py) does not run:
oneDNN's reordered weight, ``F.linear``."""

from __future__ import annotations

import pytest
import torch

import worker.models.gemm as gemm
from protocol.worker_messages import RequestRow, StepPlan
from worker.kv.kv_cache import allocate_kv_caches
from worker.load.checkpoint import Checkpoint
from worker.models import packed_gemm
from worker.models.layers import Linear, make_linear
from worker.models.loader import load_model
from worker.step.runner import ModelRunner


def test_full_precision_and_device_models_keep_their_dtype():
    assert gemm.gemm_dtype(torch.float32, "cpu") == torch.float32
    assert gemm.gemm_dtype(torch.float64, "cpu") == torch.float64
    # NOTE: only the device's type is read; no CUDA is needed to ask.
    assert gemm.gemm_dtype(torch.bfloat16, "cuda") == torch.bfloat16


def test_a_cpu_without_a_native_bf16_gemm_computes_in_float32(monkeypatch):
    monkeypatch.setattr(gemm, "native_half_gemm", lambda dtype: False)
    assert gemm.gemm_dtype(torch.bfloat16, "cpu") == torch.float32
    monkeypatch.setattr(gemm, "native_half_gemm", lambda dtype: True)
    assert gemm.gemm_dtype(torch.bfloat16, "cpu") == torch.bfloat16


@pytest.fixture
def no_packed_kernel(monkeypatch):
    """As on a CPU without AVX-512, or without the library built."""
    monkeypatch.setattr(packed_gemm, "load", lambda: None)


def test_a_widened_linear_is_a_bf16_gemm_rounded_once(monkeypatch, no_packed_kernel):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 96, generator=g).to(torch.bfloat16)
    w = torch.randn(40, 96, generator=g).to(torch.bfloat16)
    b = torch.randn(40, generator=g).to(torch.bfloat16)
    lin = make_linear(w, b, torch.float32)
    assert lin.weight.dtype == torch.float32 and lin.out_dtype == torch.bfloat16
    assert torch.equal(lin.weight, w.float())  # the bf16 values exactly
    y = lin(x)
    assert y.dtype == torch.bfloat16 and y.shape == (7, 40)
    # The exact product of the bf16 operands, rounded to bf16 once: at most one bf16
    # rounding step (2^-8 relative) from it, float32's summation order aside.
    exact = (x.double() @ w.double().T + b.double()).to(torch.bfloat16).double()
    assert torch.allclose(y.double(), exact, rtol=2**-7, atol=1e-6)
    # Same dtype (and no native bf16 GEMM to reorder for): the weights are kept as they are, no copy.
    monkeypatch.setattr(gemm, "native_half_gemm", lambda d: False)
    same = make_linear(w, b, torch.bfloat16)
    assert same.weight is w and same.out_dtype is None and isinstance(same, Linear)


def _decode_logits(path, monkeypatch, native: bool) -> tuple[torch.Tensor, torch.dtype]:
    monkeypatch.setattr(gemm, "native_half_gemm", lambda dtype: native)
    model = load_model(Checkpoint(path), torch.bfloat16, "cpu")
    c = model.config
    caches = allocate_kv_caches(c.num_layers, 16, 16, c.num_kv_heads, c.head_dim, torch.bfloat16, "cpu")
    runner = ModelRunner(model, caches, 2, 128)
    prompts = [[5, 17, 99, 3, 42, 7, 8, 250, 31, 12], [9, 9, 100, 101, 4]]
    rows = [RequestRow(0, prompts[0], [1, 2]), RequestRow(1, prompts[1], [3, 4])]
    out = runner.execute(StepPlan(0, {0: 10, 1: 5}, new_rows=rows))
    return out.logits, model.layers[0].qkv.weight.dtype


def test_the_model_gives_the_same_logits_either_way(tiny_checkpoint, monkeypatch):
    native, native_w = _decode_logits(tiny_checkpoint, monkeypatch, native=True)
    wide, wide_w = _decode_logits(tiny_checkpoint, monkeypatch, native=False)
    assert native_w == torch.bfloat16 and wide_w == torch.float32
    # NOTE: both are bfloat16 models; only the summation order of the products differs,
    # so they agree to a few bf16 rounding steps of the logits' scale.
    scale = native.abs().max()
    assert (native - wide).abs().max() <= 0.03 * scale
    assert torch.equal(native.argmax(-1), wide.argmax(-1))


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_large_float32_weight_runs_on_onednns_reordered_copy(dtype, monkeypatch, no_packed_kernel):
    monkeypatch.setattr(gemm, "native_half_gemm", lambda d: False)
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(1024, 768, generator=g) / 30).to(dtype)  # 786,432 elements: over ONEDNN_MIN_WEIGHT
    b = torch.randn(1024, generator=g).to(dtype)
    x = torch.randn(9, 768, generator=g).to(dtype)
    lin = make_linear(w, b, torch.float32)
    assert lin.kernel == "onednn" and lin.weight.is_mkldnn and tuple(lin.weight.shape) == (1024, 768)
    y = lin(x)
    assert y.dtype == dtype and y.shape == (9, 1024)
    exact = x.double() @ w.double().T + b.double()
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    assert torch.allclose(y.double(), exact.to(dtype).double(), rtol=tol, atol=1e-5)
    # Rows of any shape in front, as F.linear takes them.
    assert torch.allclose(lin(x.view(3, 3, 768)).view(9, 1024).double(), y.double())


@pytest.mark.skipif(not gemm.native_half_gemm(torch.bfloat16), reason="this CPU has no native bfloat16 GEMM")
@pytest.mark.parametrize("shape", [(40, 96), (1024, 768)])
def test_a_bf16_weight_with_a_native_gemm_runs_reordered_at_any_size(shape, no_packed_kernel):
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(*shape, generator=g) / 30).to(torch.bfloat16)
    b = torch.randn(shape[0], generator=g).to(torch.bfloat16)
    x = torch.randn(5, shape[1], generator=g).to(torch.bfloat16)
    lin = make_linear(w, b, torch.bfloat16)
    assert lin.kernel == "onednn" and lin.out_dtype is None and lin.weight.is_mkldnn
    y = lin(x)
    assert y.dtype == torch.bfloat16 and y.shape == (5, shape[0])
    # A bf16 GEMM: float32 accumulation, one rounding to bf16 of the exact product.
    exact = (x.double() @ w.double().T + b.double()).to(torch.bfloat16).double()
    assert torch.allclose(y.double(), exact, rtol=2**-7, atol=1e-5)


def test_a_half_weight_without_a_native_gemm_is_not_reordered(monkeypatch):
    monkeypatch.setattr(gemm, "native_half_gemm", lambda d: False)
    assert gemm.onednn_weight(torch.randn(1024, 768).to(torch.bfloat16)) is None
    assert gemm.onednn_weight(torch.randn(1024, 768).to(torch.float64)) is None


def test_a_small_float32_weight_stays_plain_and_column_major(no_packed_kernel):
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(384, 256, generator=g), torch.randn(8, 256, generator=g)
    lin = make_linear(w, None, torch.float32)
    assert lin.kernel == "torch" and torch.equal(lin.weight, w)
    assert lin.weight.stride() == (1, 384)  # (out, in), stored (in, out)
    assert torch.allclose(lin(x).double(), x.double() @ w.double().T, rtol=1e-5, atol=1e-5)


def test_an_untied_lm_head_is_held_once(tiny_checkpoint, no_packed_kernel):
    from safetensors.torch import load_file

    head = load_file(str(tiny_checkpoint / "model.safetensors"))["lm_head.weight"]
    model = load_model(Checkpoint(tiny_checkpoint), torch.float32, "cpu")
    assert not model.tied and torch.equal(model.lm_head, head)
    # The head's values are the projection's own storage, not a second copy.
    assert model.lm_head.data_ptr() == model.logits_proj.weight.data_ptr()
    bf16 = load_model(Checkpoint(tiny_checkpoint), torch.bfloat16, "cpu")
    assert bf16.lm_head.dtype == torch.bfloat16 and torch.equal(bf16.lm_head, head.to(torch.bfloat16))
