"""An fp8 cache is read with vLLM's CPU arithmetic (issue #45): every value in float32,
the queries widened but not scaled, q.k times the scale and the K scale on the logits,
float32 probabilities and sums, the output rounded to bfloat16 once -- on the decode
kernel, the gathered decode, and prefill chunks alike. The reference below is that
arithmetic written out in torch; the ``compare`` test runs vLLM's own CPU kernel
(``cpu_attention_with_kv_cache`` from .venv-vllm) on the same inputs. Before, the gather
paths ran SDPA in bfloat16 (probabilities rounded to bfloat16), a fifth of the outputs
an ulp or more from vLLM's.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from worker.attention.kv_quant import KVScales, quantize
from worker.attention.paged_attention import PagedAttention

NH, KVH, HD, BS, NUM_BLOCKS, N = 8, 2, 32, 32, 8, 100
TABLE = [3, 1, 5, 0]
# (first query position, how many): a whole prefill, a chunk after 64 computed, a decode.
CASES = {"prefill": 0, "chunk": 64, "decode": 99}


def inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    q = (torch.randn(N, NH, HD, generator=gen) * 1.5).to(torch.bfloat16)
    k = (torch.randn(N, KVH, HD, generator=gen) * 2.0).to(torch.bfloat16)
    v = torch.randn(N, KVH, HD, generator=gen).to(torch.bfloat16)
    return q, k, v


def slots() -> torch.Tensor:
    return torch.tensor([TABLE[t // BS] * BS + t % BS for t in range(N)])


def kvpool(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q0: int, kernels: bool) -> torch.Tensor:
    """kvpool's attention of queries [q0, N) over an e4m3 cache holding all N tokens."""
    cache = torch.zeros(2, NUM_BLOCKS, BS, KVH, HD, dtype=torch.float8_e4m3fn)
    pa = PagedAttention([cache], NH, 8, compute_dtype=torch.bfloat16, kv_scales=[KVScales()],
                        decode_kernel=kernels, prefill_kernel=kernels)
    pa.writers[0].write(k, v, slots())
    table = torch.zeros(4, 8, dtype=torch.int32)
    table[0, : len(TABLE)] = torch.tensor(TABLE)
    if q0 == N - 1:
        md = pa.build_metadata(table, slots()[q0:], [0], [N], [])
    else:
        md = pa.build_metadata(table, slots()[q0:], [], [], [(0, q0, N - q0)])
    return pa.forward(0, q[q0:].contiguous(), k[q0:], v[q0:], md)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q0: int) -> torch.Tensor:
    """vLLM's CPU arithmetic (cpu_attn_vec.hpp, scale_on_logits for fp8), written out."""
    kq = quantize(k, torch.float8_e4m3fn, 1.0, toward_zero=True).float()  # (N, kvh, hd)
    vq = quantize(v, torch.float8_e4m3fn, 1.0, toward_zero=True).float()
    qf = q[q0:].float()  # (n, nh, hd), unscaled
    g = NH // KVH
    logits = torch.einsum("nhd,khd->hnk", qf, kq.repeat_interleave(g, 1)) * HD**-0.5  # (nh, n, N)
    causal = torch.arange(N)[None, :] > torch.arange(q0, N)[:, None]  # (n, N)
    p = logits.masked_fill(causal, float("-inf")).softmax(-1)  # float32
    return torch.einsum("hnk,khd->nhd", p, vq.repeat_interleave(g, 1)).to(torch.bfloat16)  # (n, nh, hd)


@pytest.mark.parametrize("kernels", [True, False], ids=["kernel", "gather"])
@pytest.mark.parametrize("case", CASES)
def test_fp8_read_is_float32_with_the_scale_on_the_logits(case, kernels):
    q, k, v = inputs()
    got, want = kvpool(q, k, v, CASES[case], kernels), reference(q, k, v, CASES[case])
    # NOTE: float32 sums in another order may land a rounding apart in bfloat16, rarely.
    differ = (got != want).sum().item()
    assert differ <= got.numel() // 500, f"{differ} of {got.numel()} outputs differ"
    assert (got.float() - want.float()).abs().max().item() <= 2 ** -7 * want.float().abs().max().item()


# Runs in vLLM's venv: vLLM's CPU write and attention on the inputs given as JSON on stdin; prints
# each case's output (bfloat16 bits).
_VLLM_PROBE = r"""
import json, sys, torch, vllm._custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
d = json.loads(sys.stdin.read())
q, k, v = (torch.tensor(d[x]).to(torch.bfloat16) for x in "qkv")
NH, KVH, HD, BS, NB = d["shape"]
table = torch.tensor([d["table"]], dtype=torch.int32)
isa = _get_attn_isa(torch.bfloat16, BS, HD, "fp8")
cache = torch.zeros(NB, KVH, 2 * BS, HD, dtype=torch.uint8)
kc, vc = cache.chunk(2, dim=2)
ops.cpu_attn_reshape_and_cache(k, v, kc, vc, torch.tensor(d["slots"]), isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="fp8")
out, n = {}, q.shape[0]
for name, q0 in d["cases"].items():
    qq = q[q0:].contiguous()
    o = torch.zeros_like(qq)
    qsl, sl = torch.tensor([0, n - q0], dtype=torch.int32), torch.tensor([n], dtype=torch.int32)
    md = ops.cpu_attn_get_scheduler_metadata(1, NH, KVH, HD, sl, torch.bfloat16, qsl, True, -1, isa, False, None, "fp8")
    ops.cpu_attention_with_kv_cache(qq, kc, vc, o, qsl, sl, HD ** -0.5, True, None, -1, table, 0.0, md, None, None,
                                    k_scale=1.0, v_scale=1.0, kv_cache_dtype="fp8")
    out[name] = o.view(torch.int16).reshape(-1).tolist()
print(json.dumps(out))
"""


@pytest.mark.compare
def test_fp8_read_equals_vllms_cpu_kernel():
    vllm_python = Path(".venv-vllm/bin/python")
    if not vllm_python.exists():
        pytest.skip("no .venv-vllm")
    q, k, v = inputs()
    arg = {"q": q.float().tolist(), "k": k.float().tolist(), "v": v.float().tolist(), "shape": [NH, KVH, HD, BS, NUM_BLOCKS],
           "table": TABLE, "slots": slots().tolist(), "cases": CASES}
    r = subprocess.run([str(vllm_python), "-c", _VLLM_PROBE], input=json.dumps(arg), capture_output=True, text=True, timeout=300,
                       env={"VLLM_TARGET_DEVICE": "cpu", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    for case, q0 in CASES.items():
        want = torch.tensor(got[case], dtype=torch.int16).view(torch.bfloat16).view(N - q0, NH, HD)
        for kernels in (True, False):
            ours = kvpool(q, k, v, q0, kernels)
            assert torch.equal(ours, want), f"{case}, kernels={kernels}: {(ours != want).sum().item()} outputs differ from vLLM's"
