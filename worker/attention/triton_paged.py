"""Paged attention on CUDA reading the cache in place, in Triton
(``worker.attention.triton_kernel``): ``TritonDecode`` and ``TritonPrefill`` take the
calls of the CPU's C kernels (``paged_decode``, ``paged_prefill``), so
``PagedAttention`` selects them on CUDA as it selects the C kernels on CPU.

The C kernels move each K/V byte once; on CUDA the torch path gathered every block a
step reads into a workspace, then ran SDPA over the copy: twice. Float32, bfloat16 and
float16 caches in their own dtype, fp8 caches (e4m3fn, e5m2) read into any of them,
sliding windows, the log-sum-exp cascade attention merges.

On a CPU tensor the kernel runs only under Triton's interpreter (``TRITON_INTERPRET=1``
before this module is first imported): that is how the suite checks it without a GPU.

NOTE: block ids are not checked on CUDA (that would read the table back, a wait each
layer); the worker's plan check refuses a plan with an id outside the pool before it
reaches the table (``worker.step.plan_check``). On CPU, where reading it costs nothing,
they are.
"""

from __future__ import annotations

import functools
import logging
import os

import numpy as np
import torch

log = logging.getLogger(__name__)

_COMPUTE = (torch.float32, torch.bfloat16, torch.float16)
_FP8 = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}  # triton_kernel.KV_E4M3, KV_E5M2
MAX_HEAD_DIM = 256
MAX_GROUP = 64
LOG2E = 1.4426950408889634


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (read when the kernel is defined)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def supports(cache_dtype: torch.dtype, dtype: torch.dtype, device: torch.device, head_dim: int, group: int) -> bool:
    """Whether the kernel reads a cache of this dtype in this compute dtype on this device
    (CUDA; a CPU only under the interpreter), with these heads."""
    if device.type not in ("cuda", "cpu") or (device.type == "cpu" and not interpreting()):
        return False
    if dtype not in _COMPUTE or not (cache_dtype == dtype or cache_dtype in _FP8):
        return False
    return 1 <= head_dim <= MAX_HEAD_DIM and 1 <= group <= MAX_GROUP


def num_warps(float32: bool, block_m: int) -> int:
    """Warps per program: 8 for float32 tiles of 64 score rows, whose IEEE products are FMAs
    held in registers (at 4 warps they spill: ``python -m bench.gpu.kernel_compile``), else 4."""
    return 8 if float32 and block_m >= 64 else 4


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class _TritonAttention:
    """What decode and prefill share: the checks, the tiles' upload and the launch."""

    name = "paged attention"

    def __init__(self, kernel, block_q: int, tile_n: int):
        self._kernel = kernel
        self.block_q = block_q  # queries of one request a program takes (decode: 1)
        self.tile_n = tile_n  # keys a program reads at a time
        # The tiles of the last call, kept for the next layer of the same step (its
        # metadata arrays are the same objects): (key arrays, device tensor).
        self._last: tuple[tuple, torch.Tensor] | None = None

    def supports(self, cache_dtype: torch.dtype, dtype: torch.dtype, device: torch.device, head_dim: int, group: int) -> bool:
        return supports(cache_dtype, dtype, device, head_dim, group)

    def _check(self, q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, out: torch.Tensor) -> None:
        _, _, _, kvh, hd = cache.shape
        T, nh, _ = q.shape
        if nh % kvh or not self.supports(cache.dtype, q.dtype, cache.device, hd, nh // kvh) or out.dtype != q.dtype:
            raise ValueError(f"{self.name}: q {q.dtype} and out {out.dtype} must share a dtype the {cache.dtype} cache is read in "
                             f"on {cache.device}, with heads it takes ({nh} over {kvh})")
        if not cache[0].is_contiguous() or not cache[1].is_contiguous():
            raise ValueError(f"{self.name}: the cache's K and V halves must each be contiguous")
        for name, t in (("q", q), ("out", out)):
            if t.stride(2) != 1 or t.stride(1) != hd:
                raise ValueError(f"{self.name}: {name} {tuple(t.shape)} needs contiguous heads")
        if table.dtype != torch.int32 or not table.is_contiguous():
            raise ValueError(f"{self.name}: the block table must be contiguous int32, got {table.dtype}")
        if len({q.device, cache.device, table.device, out.device}) != 1:
            raise ValueError(f"{self.name}: q, the cache, the table and out must be on one device")

    def _tiles(self, key: tuple, build, device: torch.device) -> torch.Tensor:
        """The tiles on the device, built once per step (every layer passes the same arrays)."""
        last = self._last
        if last is not None and len(last[0]) == len(key) and all(a is b for a, b in zip(last[0], key, strict=True)):
            return last[1]
        tiles = torch.from_numpy(build()).to(device, non_blocking=True)
        self._last = (key, tiles)
        return tiles

    @staticmethod
    def _check_reads(name: str, cache: torch.Tensor, table: torch.Tensor, rows: np.ndarray, last_key: np.ndarray) -> None:
        """Rows inside the table, reading columns inside it; on CPU also block ids inside the cache."""
        if len(rows) == 0:
            return
        if rows.min() < 0 or rows.max() >= table.shape[0] or last_key.min() < 0:
            raise ValueError(f"{name}: rows outside the table {tuple(table.shape)}")
        cols = last_key // cache.shape[2] + 1
        if cols.max() > table.shape[1]:
            raise ValueError(f"{name}: rows outside the table {tuple(table.shape)}")
        if table.device.type == "cpu":
            t = table.numpy()
            for r, c in zip(rows.tolist(), cols.tolist(), strict=True):
                ids = t[r, :c]
                if len(ids) and (ids.min() < 0 or ids.max() >= cache.shape[1]):
                    raise IndexError(f"{name}: a block id in the table is outside 0..{cache.shape[1] - 1}")

    def _launch(self, q, cache, table, tiles: torch.Tensor, out, lse, scale: float, kv_scales, window: int) -> None:
        _, _, bs, kvh, hd = cache.shape
        nh = q.shape[1]
        group = nh // kvh
        group_p = _pow2(group)
        block_m = max(16, self.block_q * group_p)
        kind = _FP8.get(cache.dtype, 0)
        k_half, v_half = cache[0], cache[1]
        if kind:
            k_half, v_half = k_half.view(torch.uint8), v_half.view(torch.uint8)
        grid = (tiles.shape[0], kvh)
        self._kernel[grid](
            q, q.stride(0), q.stride(1), k_half, v_half, out, out.stride(0), out.stride(1),
            lse if lse is not None else out, table, table.stride(0), tiles,
            scale * kv_scales[0] * LOG2E, kv_scales[1], window,
            BS=bs, KVH=kvh, HD=hd, HD_P=max(16, _pow2(hd)), GROUP=group, GROUP_P=group_p, BLOCK_M=block_m,
            TILE_N=self.tile_n, KV_KIND=kind, WRITE_LSE=lse is not None, UPCAST=q.device.type != "cuda",
            num_warps=num_warps(q.dtype == torch.float32, block_m),
        )


class TritonDecode(_TritonAttention):
    """``__call__`` is one layer's decode rows, as ``paged_decode.PagedDecode``'s."""

    name = "paged decode"

    def __call__(self, q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, rows: np.ndarray, first_col: np.ndarray,
                 nkeys: np.ndarray, lead: np.ndarray, scale: float, out: torch.Tensor, lse: torch.Tensor | None = None,
                 kv_scales: tuple[float, float] = (1.0, 1.0)) -> None:
        """out[i] = attention of q[i] (B, nh, hd) over keys [lead[i], nkeys[i]) counted from
        column first_col[i] of table row rows[i]; lse: (B, kvh, nh // kvh) float32 or None."""
        self._check(q, cache, table, out)
        B = q.shape[0]
        bs = cache.shape[2]
        arrays = [np.asarray(a, dtype=np.int64) for a in (rows, first_col, nkeys, lead)]
        if any(len(a) != B for a in arrays) or out.shape[0] != B:
            raise ValueError(f"{self.name}: rows, first_col, nkeys, lead and out need {B} entries each")
        rows_, first_col_, nkeys_, lead_ = arrays
        if B and ((nkeys_ < 1).any() or (lead_ < 0).any() or (lead_ >= nkeys_).any()):
            raise ValueError(f"{self.name}: each row needs at least one key after its lead")
        if lse is not None and (lse.dtype != torch.float32 or not lse.is_contiguous() or lse.numel() != out.numel() // q.shape[2]):
            raise ValueError(f"{self.name}: lse must be ({B}, {cache.shape[3]}, {q.shape[1] // cache.shape[3]}) contiguous float32")
        self._check_reads(self.name, cache, table, rows_, first_col_ * bs + nkeys_ - 1)
        if B == 0:
            return

        def build() -> np.ndarray:
            base = first_col_ * bs
            return np.stack([rows_, np.arange(B), base + nkeys_ - 1, np.ones(B, np.int64), base + lead_, np.arange(B)],
                            axis=1).astype(np.int32)

        tiles = self._tiles((rows, first_col, nkeys, lead, bs), build, q.device)
        self._launch(q, cache, table, tiles, out, lse, scale, kv_scales, 0)


class TritonPrefill(_TritonAttention):
    """``__call__`` is one layer's prefill chunks, as ``paged_prefill.PagedPrefill``'s."""

    name = "paged prefill"

    def __call__(self, q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, rows: np.ndarray, first: np.ndarray,
                 n: np.ndarray, offset: np.ndarray, window: int, scale: float, out: torch.Tensor,
                 kv_scales: tuple[float, float] = (1.0, 1.0)) -> None:
        """out[offset[c]:offset[c] + n[c]] = causal attention of the same tokens of q (T, nh,
        hd), at positions [first[c], first[c] + n[c]), over the keys of table row rows[c]
        (only the last ``window`` positions when window > 0)."""
        self._check(q, cache, table, out)
        if tuple(out.shape) != tuple(q.shape):
            raise ValueError(f"{self.name}: out {tuple(out.shape)} needs q's shape {tuple(q.shape)}")
        arrays = [np.asarray(a, dtype=np.int64) for a in (rows, first, n, offset)]
        if len({len(a) for a in arrays}) != 1:
            raise ValueError(f"{self.name}: rows, first, n and offset need one entry per chunk each")
        rows_, first_, n_, offset_ = arrays
        if len(n_) and ((n_ < 1).any() or (first_ < 0).any() or (offset_ < 0).any() or int((offset_ + n_).max()) > q.shape[0]):
            raise ValueError(f"{self.name}: a chunk's tokens run past q's {q.shape[0]} (or it has none)")
        if window < 0:
            raise ValueError(f"{self.name}: window must be >= 0, got {window}")
        self._check_reads(self.name, cache, table, rows_, first_ + n_ - 1)
        if len(n_) == 0:
            return
        bq = self.block_q

        def build() -> np.ndarray:
            per_chunk = -(-n_ // bq)
            chunk = np.repeat(np.arange(len(n_)), per_chunk)
            start = (np.arange(len(chunk)) - np.repeat(np.cumsum(per_chunk) - per_chunk, per_chunk)) * bq
            count = np.minimum(bq, n_[chunk] - start)
            return np.stack([rows_[chunk], offset_[chunk] + start, first_[chunk] + start, count, np.zeros_like(chunk),
                             np.zeros_like(chunk)], axis=1).astype(np.int32)

        tiles = self._tiles((rows, first, n, offset, bq), build, q.device)
        self._launch(q, cache, table, tiles, out, None, scale, kv_scales, window)


@functools.cache
def _kernel():
    """The jitted kernel, or None when Triton does not import (logged once)."""
    try:
        from worker.attention.triton_kernel import paged_attention_kernel
    except ImportError as e:  # NOTE: no Triton on this host: the gather and SDPA run instead
        log.warning("Triton does not import (%s); CUDA attention gathers blocks for SDPA", e)
        return None
    return paged_attention_kernel


def load_decode(tile_n: int = 32) -> TritonDecode | None:
    kernel = _kernel()
    return None if kernel is None else TritonDecode(kernel, 1, tile_n)


def load_prefill(block_q: int = 16, tile_n: int = 32) -> TritonPrefill | None:
    kernel = _kernel()
    return None if kernel is None else TritonPrefill(kernel, block_q, tile_n)


def self_check(kernel: _TritonAttention, cache_dtype: torch.dtype, dtype: torch.dtype, device: torch.device, block_size: int,
               num_kv_heads: int, head_dim: int, group: int) -> str | None:
    """None when one small call on ``device`` (this cache's dtypes, block size and heads:
    the kernel a step compiles) equals attention computed by torch; else what went wrong.
    NOTE: a Triton that compiles differently (another version, another GPU) fails here, at
    start-up, and the worker gathers instead, not at its first step."""
    gen = torch.Generator().manual_seed(0)
    nh, bs = num_kv_heads * group, block_size
    cache = torch.randn(2, 4, bs, num_kv_heads, head_dim, generator=gen).to(cache_dtype)
    table = torch.tensor([[2, 0, 3, 1]], dtype=torch.int32)
    q = torch.randn(3, nh, head_dim, generator=gen).to(dtype)
    decode = isinstance(kernel, TritonDecode)
    # Decode: rows of 1 and 2 blocks + 1 keys; prefill: 3 queries from position bs - 1.
    keys = [1, 2 * bs + 1, bs + 1] if decode else [bs, bs + 1, bs + 2]
    try:
        on = [t.to(device) for t in (q, cache, table)]
        out = torch.full_like(on[0], float("nan"))
        if decode:
            kernel(*on, np.zeros(3), np.zeros(3), np.array(keys), np.zeros(3), head_dim**-0.5, out)
        else:
            kernel(*on, np.zeros(1), np.array([bs - 1]), np.array([3]), np.zeros(1), 0, head_dim**-0.5, out)
        got = out.float().cpu()
    except Exception as e:  # noqa: BLE001 - any failure to compile or launch means: do not use it
        return f"{type(e).__name__}: {e}"
    flat = cache[:, table[0].long()].reshape(2, -1, num_kv_heads, head_dim).float()  # the row's keys in order
    for i, n in enumerate(keys):
        k, v = flat[0, :n].repeat_interleave(group, 1), flat[1, :n].repeat_interleave(group, 1)  # (n, nh, hd)
        s = torch.einsum("hd,nhd->hn", q[i].float(), k) * head_dim**-0.5
        want = torch.einsum("hn,nhd->hd", torch.softmax(s, -1), v)
        if not torch.allclose(got[i], want, rtol=3e-2, atol=3e-2):
            return f"row {i} differs from torch's attention by {float((got[i] - want).abs().max()):.3g}"
    return None
