"""The projections' kernel (``python -m bench gemm``): ``worker.models.packed_gemm`` against
oneDNN's matmul over its reordered weight (what the projections ran on before, and what
vLLM's CPU backend runs), through the 51M Llama's four projection shapes (qkv 1280 x 768,
o 768 x 768, gate/up 4096 x 768, down 768 x 2048) times its 8 layers: 100 MB of bfloat16
weights, 200 MB of float32, more than the cache holds, as a decode step reads them. One
torch thread, alternating rounds; 8 rows (a decode step at concurrency 8), 64 (at 64)
and 256 (a prefill). Target: the packed kernel faster at every size. Rows say "skipped"
where the library does not run (no AVX-512 F/BF16, not built).
"""

from __future__ import annotations

import torch

from bench.table import Row
from bench.worker_bench import best_interleaved_us, warm_up
from worker.models import packed_gemm

SHAPES = ((1280, 768), (768, 768), (4096, 768), (768, 2048))  # (out, in) of llama50m's projections
LAYERS = 8
ROW_COUNTS = (8, 64, 256)


def rows() -> list[Row]:
    kernel = packed_gemm.load()
    if kernel is None or not torch.backends.mkldnn.is_available():
        return [Row("gemm: skipped (packed_gemm or oneDNN unavailable on this CPU)", 0.0, "")]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = []
    try:
        gen = torch.Generator().manual_seed(0)
        for dtype in (torch.bfloat16, torch.float32):
            weights = [(torch.randn(n, k, generator=gen) / k**0.5).to(dtype) for _ in range(LAYERS) for n, k in SHAPES]
            packed = [kernel.pack(w) for w in weights]
            onednn = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
            gb = sum(w.numel() * w.element_size() for w in weights) / 1e9
            params = sum(w.numel() for w in weights)
            del weights
            for m in ROW_COUNTS:
                x = {k: torch.randn(m, k, generator=gen).to(dtype) for _, k in SHAPES}

                def ours(x=x, packed=packed):
                    for p in packed:
                        kernel(x[kernel.shape(p)[1]], p, None)

                def theirs(x=x, onednn=onednn):
                    for w in onednn:
                        torch.ops.mkldnn._linear_pointwise(x[w.shape[1]], w, None, "none", [], "")

                warm_up(ours, theirs, seconds=0.5)
                us, them = best_interleaved_us(ours, theirs, rounds=3)
                name = f"gemm: {str(dtype)[6:]} {m} rows x llama50m's projections ({gb * 1e3:.0f} MB)"
                out += [
                    Row(f"{name}, oneDNN", them / 1e3, "ms"),
                    Row(f"{name}, packed ({gb / (us / 1e6):.1f} GB/s, {2 * m * params / us / 1e3:.0f} GFLOP/s)", us / 1e3,
                        "ms", "< oneDNN", us < them),
                ]
    finally:
        torch.set_num_threads(threads)
    return out


if __name__ == "__main__":
    from bench.table import print_table

    print_table(rows())
