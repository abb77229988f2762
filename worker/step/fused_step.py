"""A step's decoder layers in one native call (``csrc/fused_step.c``, loaded with ctypes),
where the model and its cache allow it.

A decode step of a small model is short enough that the interpreter between its kernels
shows: ``DecoderModel.forward`` makes some dozen Python calls a layer (norms, projections,
the rotary embedding, the KV write, attention, residual adds), each a few microseconds of
dispatch and argument checks around a kernel that may itself take only a few. The library
runs the same kernels (their own entry points, passed as addresses) in the same order over
the same buffers, so the hidden states are the layer-by-layer path's bit for bit, and the
step pays one call. Steps with chunks (prefills, and rows verifying drafts) run through it
too, their chunks on the in-place prefill kernel.

It takes what the C kernels take and nothing else: a bfloat16 Llama-style model (no
per-head q/k norms, no sandwich norms, no local RoPE, SiLU, one rank), every projection on
the packed GEMM, a bfloat16 KV cache read by the in-place kernels; and a step under one
attention metadata without a decode order or shared prefixes. Anything else (hybrid
groups, fp8, Gemma, tensor parallelism, a machine without the libraries) runs
``DecoderModel.forward`` as before.

The library is built by ``make install`` (``python -m worker.step.fused_step`` rebuilds
it) into an ignored ``csrc/fused_step.so``.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from worker.attention import paged_decode, paged_prefill
from worker.attention.metadata import AttentionMetadata
from worker.attention.paged_attention import PagedAttention
from worker.cpu import native
from worker.models import norm_act, packed_gemm
from worker.models.decoder import DecoderLayer, DecoderModel
from worker.models.layers import Linear, rms_norm

SOURCE = Path(__file__).parent / "csrc" / "fused_step.c"
LIBRARY = SOURCE.with_suffix(".so")
ABI = 2  # fused_step_abi() of the source this module calls
CFLAGS = ["-O3", "-march=native", "-shared", "-fPIC"]
FALLBACK = "decode steps run the decoder a kernel call at a time"
# NOTE: the orders of the source's enums K_*, L_* and D_*.
LAYER_FIELDS = ("input_norm", "qkv", "qkv_bias", "o", "o_bias", "post_norm", "gate_up", "down", "k_cache", "v_cache")
DIMS = ("T", "H", "nh", "kvh", "hd", "inter", "num_blocks", "block_size")
MLP_CHUNK_ROWS = 256  # the source's: gate/up's rows at a time
_P = ctypes.c_void_p
_I64 = ctypes.c_int64


class StepRows(ctypes.Structure):
    """The source's ``struct step_rows``: the decode rows, then the chunks, as the
    attention kernels read them."""

    _fields_ = [("table", _P), ("table_rows", _I64), ("table_cols", _I64),
                ("num_decode", _I64), ("d_row", _P), ("d_first_col", _P), ("d_nkeys", _P), ("d_lead", _P),
                ("num_chunks", _I64), ("p_row", _P), ("p_first", _P), ("p_n", _P), ("p_off", _P),
                ("window", _I64)]


class FusedStep:
    """One model and its cache, their pointers gathered once; ``forward`` runs a step."""

    def __init__(self, fn: ctypes._CFuncPtr, model: DecoderModel, attention: PagedAttention, kernels: list[int]):
        self._fn = fn
        self.model = model
        self.attention = attention
        c = model.config
        self.kernels = np.asarray(kernels, dtype=np.uint64)
        ptrs = []
        for layer, cache in zip(model.layers, attention.kv_caches, strict=True):
            lin = (layer.qkv, layer.o, layer.mlp.gate_up, layer.mlp.down)
            ptrs += [layer.input_norm.data_ptr(), lin[0].weight.data_ptr(), _ptr(lin[0].bias), lin[1].weight.data_ptr(),
                     _ptr(lin[1].bias), layer.post_attention_norm.data_ptr(), lin[2].weight.data_ptr(),
                     lin[3].weight.data_ptr(), cache[0].data_ptr(), cache[1].data_ptr()]
        self.layers = np.asarray(ptrs, dtype=np.uint64)  # NOTE: the tensors live as long as the model and cache
        self.inter = model.layers[0].mlp.gate_up.out_features // 2
        hd, nh, kvh = c.head_dim, model.num_heads, model.num_kv_heads
        _, num_blocks, block_size, _, _ = attention.kv_caches[0].shape
        # The source's DIMS; the first, the step's tokens, is set each step.
        self.dims = np.asarray([0, c.hidden_size, nh, kvh, hd, self.inter, num_blocks, block_size], dtype=np.int64)
        # Scratch elements per row (the source's h, qkv, qk, att, y and act), and gu's chunk.
        self.scratch_per_row = 2 * c.hidden_size + (nh + 2 * kvh) * hd + (nh + kvh) * hd + nh * hd + self.inter
        self.chunk_scratch = 2 * self.inter

    @staticmethod
    def supports(model: DecoderModel, attention: PagedAttention) -> bool:
        """Whether every layer of ``model`` over ``attention``'s caches is one the library runs."""
        c = model.config
        if model.dtype != torch.bfloat16 or model.device.type != "cpu" or c.gemma or model.embed_scale is not None:
            return False
        if (model.shard is not None and model.shard.size > 1) or model.rms_norm is not rms_norm or model.local_rotary is not None:
            return False
        if attention.decode_kernel is not paged_decode.load() or attention.fp8 or len(attention.kv_caches) != len(model.layers):
            return False
        if attention.prefill_kernel is not None and attention.prefill_kernel is not paged_prefill.load():
            return False
        if any(kv.dtype != torch.bfloat16 or not (kv[0].is_contiguous() and kv[1].is_contiguous()) for kv in attention.kv_caches):
            return False
        return all(_plain_layer(layer, c.hidden_size) for layer in model.layers)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor,
                metadata: AttentionMetadata | list[AttentionMetadata]) -> torch.Tensor | None:
        """The final normed hidden states (T, H) of the step's T tokens, as ``model.forward``
        gives them; None where this step is not one the library runs."""
        rows = self._step_rows(metadata, len(token_ids))
        if rows is None:
            return None
        m, c = self.model, self.model.config
        T = len(token_ids)
        cos, sin = m.rotary.cos_sin(positions, m.dtype)  # (T, 1, hd/2) each, contiguous
        x = m.embed[token_ids]  # (T, H), a new tensor: the layers add into it
        scratch = torch.empty(T * self.scratch_per_row + min(T, MLP_CHUNK_ROWS) * self.chunk_scratch, dtype=torch.bfloat16)
        self.dims[0] = T
        slots = metadata.slot_mapping.to(torch.int64).contiguous()
        where = ctypes.c_int64(-1)
        rc = self._fn(self.kernels.ctypes.data, self.layers.ctypes.data, len(m.layers), self.dims.ctypes.data, c.rms_norm_eps,
                      self.attention.kernel_scale, x.data_ptr(), cos.data_ptr(), sin.data_ptr(), slots.data_ptr(),
                      ctypes.byref(rows[0]), scratch.data_ptr(), torch.get_num_threads(), ctypes.byref(where))
        if rc == -1:
            raise IndexError(f"fused step: layer {where.value}: a block or slot outside the cache's {self.dims[6]} blocks")
        if rc != 0:
            raise ValueError(f"fused step: layer {where.value}: a kernel refused its arguments (rc {rc})")
        return m.rms_norm(x, m.norm, c.rms_norm_eps)

    def _step_rows(self, md: AttentionMetadata | list[AttentionMetadata], T: int) -> tuple[StepRows, list] | None:
        """The step's rows for the kernels (with the arrays they point into, kept alive
        by the caller), or None where the step needs a path the library does not take."""
        if not isinstance(md, AttentionMetadata) or md.prefills or md.decode_groups or md.shared_prefixes or md.decode_order is not None:
            return None
        d, p = md.decode_rows, md.prefill_rows
        if (d is None) != (md.num_decode_tokens == 0) or (p is not None and self.attention.prefill_kernel is None):
            return None
        num_chunk_tokens = 0 if p is None else int(p.num_queries.sum())
        if md.num_decode_tokens + num_chunk_tokens != T or (d is None and p is None):
            return None
        dec = [] if d is None else [np.ascontiguousarray(a, dtype=np.int64) for a in (d.table_row, d.first_col, d.num_keys, d.lead)]
        pre = [] if p is None else [np.ascontiguousarray(a, dtype=np.int64) for a in (p.table_row, p.first, p.num_queries, p.offset)]
        table = d.table if d is not None else p.table
        rows = StepRows(table.data_ptr(), table.shape[0], table.shape[1], md.num_decode_tokens,
                        *([a.ctypes.data for a in dec] or [None] * 4), 0 if p is None else len(p.table_row),
                        *([a.ctypes.data for a in pre] or [None] * 4), md.sliding_window)
        return rows, dec + pre


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _plain_layer(layer: DecoderLayer, hidden: int) -> bool:
    """A pre-norm Llama layer whose projections are all bfloat16 on the packed GEMM."""
    if layer.q_norm is not None or layer.pre_feedforward_norm is not None or layer.post_feedforward_norm is not None:
        return False
    if layer.local_rope or layer.mlp.act is not F.silu or layer.mlp.gate_up.bias is not None or layer.mlp.down.bias is not None:
        return False
    norms = (layer.input_norm, layer.post_attention_norm)
    if any(n.dtype != torch.bfloat16 or not n.is_contiguous() or n.shape != (hidden,) for n in norms):
        return False
    lins = (layer.qkv, layer.o, layer.mlp.gate_up, layer.mlp.down)
    return all(type(lin) is Linear and lin.kernel == "packed" and lin.out_dtype is None and lin.weight.dtype == torch.bfloat16
               and (lin.bias is None or lin.bias.is_contiguous()) for lin in lins)


def for_model(model: DecoderModel, attention: PagedAttention) -> FusedStep | None:
    """The fused step for ``model`` over ``attention``'s caches, or None where it does not
    apply or a library is missing (then ``model.forward`` runs every step)."""
    lib = load()
    gemm, ops, attend = packed_gemm.load(), norm_act.load(), paged_decode.load()
    if lib is None or gemm is None or ops is None or attend is None or not FusedStep.supports(model, attention):
        return None
    chunks = 0 if attention.prefill_kernel is None else attention.prefill_kernel.address
    kernels = [gemm.address, *ops.addresses, attend.address, chunks]  # the source's K_GEMM .. K_PREFILL
    return FusedStep(lib.fused_step, model, attention, kernels)


@functools.cache
def load() -> ctypes.CDLL | None:
    """The library, its entry point typed, or None (logged once at debug level) when it is
    not built or this CPU lacks the instructions it was built for."""
    lib = native.load(LIBRARY, "fused_step_abi", ABI, FALLBACK, "fused_step_available")
    if lib is not None:
        lib.fused_step.restype = ctypes.c_int
        lib.fused_step.argtypes = [_P, _P, _I64, _P, ctypes.c_float, ctypes.c_float, _P, _P, _P, _P, _P, _P, ctypes.c_int, _P]
    return lib


if __name__ == "__main__":
    native.build_main(SOURCE, CFLAGS, FALLBACK)
