"""The fp8 KV cache (``--kv-cache-dtype fp8|fp8_e4m3|fp8_e5m2``): quantize in the paged
write, dequantize after the gather.

vLLM 0.32's meanings, on every device: ``fp8`` is ``fp8_e4m3`` (OCP E4M3, torch's
``float8_e4m3fn``, largest finite 448); ``fp8_e5m2`` is torch's ``float8_e5m2`` (largest
57344). One scale per tensor (K and V of a layer), 1.0 unless the checkpoint carries it:
the cache holds ``x / scale`` cast to fp8, saturated to the largest finite value, and
attention reads ``fp8 * scale``.

How the cast rounds follows vLLM's kernel on each device:

* CPU (``cpu_attn_reshape_and_cache``): toward zero. NOTE: read off vLLM's kernel, not
  its docs: its bytes equal ``quantize(..., toward_zero=True)`` for either format,
  bfloat16 or float32 input, any scale (tests/worker/attention/test_kv_quant.py keeps the vLLM check).
* CUDA (``scaled_fp8_conversion``: ``__nv_cvt_float_to_fp8(x / scale, __NV_SATFINITE, ...)``):
  to nearest even, saturating.

The caches are torch fp8 tensors, not vLLM's uint8 views: the dtype says which format the
bytes are in; copies that only move bytes (the gather, the paged write on CPU, the host
tier) go through same-size integer views.

Reading (``dequantize``) is integer arithmetic, not torch's fp8 cast (element by element
on CPU, several times slower than the attention it feeds): an fp8 byte's exponent and
mantissa fields, moved to the compute dtype's places, are that dtype's bits of the value
times 2^(fp8 bias - compute bias), subnormals included; one multiply by the inverse power
of two and the scale restores it. NOTE: the fp8 NaN and infinity patterns read as finite
values; the write saturates, so only a NaN from the model itself can produce one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPES: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV tensors' dtype: the model's for ``auto``, else the fp8 format the name means."""
    if kv_cache_dtype == "auto":
        return model_dtype
    try:
        return FP8_DTYPES[kv_cache_dtype]
    except KeyError:
        raise ValueError(f"--kv-cache-dtype {kv_cache_dtype!r} is not supported (supported: auto, {', '.join(FP8_DTYPES)})") from None


def quantize(x: torch.Tensor, fp8: torch.dtype, scale: float, toward_zero: bool) -> torch.Tensor:
    """``x / scale`` in ``fp8``, saturated to its largest finite value; rounded toward zero
    (vLLM's CPU kernel) or to nearest even (its CUDA kernel). x: any shape, any float dtype."""
    top = torch.finfo(fp8).max
    xf = x.float()
    if scale != 1.0:
        xf = xf / scale
    xf = xf.clamp(-top, top)
    q = xf.to(fp8)  # to nearest even
    if toward_zero:
        # NOTE: fp8 magnitudes order like their low 7 bits, so one step toward zero is
        # the byte minus one wherever rounding went up in magnitude (never at 0).
        bits = q.view(torch.uint8)
        bits.sub_((q.float().abs() > xf.abs()).to(torch.uint8))
    return q


# (mantissa bits, exponent bias) of each format, and the same-size integer of each compute dtype.
_FIELDS = {torch.float8_e4m3fn: (3, 7), torch.float8_e5m2: (2, 15), torch.bfloat16: (7, 127), torch.float16: (10, 15),
           torch.float32: (23, 127), torch.float64: (52, 1023)}
_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def dequantize(raw: torch.Tensor, fp8: torch.dtype, out: torch.Tensor, scale: float) -> torch.Tensor:
    """``out`` (any float dtype but fp8, the shape of ``raw``) = the fp8 values whose bytes
    are ``raw`` (uint8), times ``scale``; four elementwise passes, in place in ``out``."""
    fp8_mant, fp8_bias = _FIELDS[fp8]
    mant, bias = _FIELDS[out.dtype]
    bits = out.element_size() * 8
    shift = mant - fp8_mant
    # The sign bit, and the 7 exponent and mantissa bits moved up by shift; as a signed int.
    mask = (1 << (bits - 1)) | (0x7F << shift)
    mask -= 1 << bits
    w = out.view(_INT[out.element_size()])
    w.copy_(raw.view(torch.int8))  # NOTE: sign-extended, so the sign bit lands on top
    # NOTE: the shift as a multiply: torch's in-place shift goes through a temporary.
    w.mul_(1 << shift).bitwise_and_(mask)
    factor = 2.0 ** (bias - fp8_bias)
    if factor * scale > torch.finfo(torch.float32).max:
        # NOTE: torch multiplies in float32; one factor would overflow there, and the
        # power of two alone is exact, so the value rounds once either way.
        return out.mul_(factor).mul_(scale)
    return out.mul_(factor * scale)


@dataclass(frozen=True, slots=True)
class KVScales:
    """One layer's per-tensor scales (vLLM's ``_k_scale_float``, ``_v_scale_float``)."""

    k: float = 1.0
    v: float = 1.0


UNSCALED = KVScales()


def checkpoint_kv_scales(k: float | None, v: float | None) -> KVScales:
    """A layer's scales from what its checkpoint holds, as vLLM's BaseKVCacheMethod:
    both given, each its own; neither, 1.0; only one, that one for both."""
    if k is not None and v is not None:
        return KVScales(k, v)
    if k is None and v is None:
        return KVScales()
    one = k if k is not None else v
    return KVScales(one, one)
