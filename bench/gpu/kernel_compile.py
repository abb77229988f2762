"""``python -m bench.gpu.kernel_compile [--arch 90]``: the paged attention kernel compiled by
this host's Triton for a CUDA architecture, no GPU needed (Triton's wheel carries ptxas):
every variant the worker launches (each compute dtype, fp8 caches, the decode tile with
and without the log-sum-exp, the prefill tile), with ptxas's registers and spills and
whether the 16-bit products run on the tensor cores (wgmma on Hopper). Exit 1 when a
variant does not compile or spills.

NOTE: run in a process of its own with TRITON_INTERPRET unset (``python -m bench gpu``
and the suite do): under the interpreter the kernel is no compiled function.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource

from worker.attention.triton_kernel import paged_attention_kernel
from worker.attention.triton_paged import num_warps

# (name, compute dtype, KV_KIND, BLOCK_M, WRITE_LSE); SmolLM2's heads (64 wide, 3 to a kv
# head) and block size 16, as the worker launches them: decode tiles of 16 rows, prefill 64.
VARIANTS = [("decode bf16", "bf16", 0, 16, False), ("decode bf16 + lse", "bf16", 0, 16, True), ("prefill bf16", "bf16", 0, 64, False),
            ("decode fp16", "fp16", 0, 16, False), ("prefill fp16", "fp16", 0, 64, False), ("decode fp32", "fp32", 0, 16, False),
            ("prefill fp32", "fp32", 0, 64, False), ("decode fp8 e4m3 -> bf16", "bf16", 1, 16, False),
            ("prefill fp8 e4m3 -> bf16", "bf16", 1, 64, False), ("decode fp8 e5m2 -> fp32", "fp32", 2, 16, False)]
HEAD_DIM, GROUP, KV_HEADS, BLOCK_SIZE, TILE_N = 64, 3, 3, 16, 32


@dataclass(frozen=True)
class Compiled:
    name: str
    registers: int
    spilled: int  # bytes of spill stores and loads
    tensor_cores: bool  # wgmma (Hopper) or mma in the PTX

    @property
    def ok(self) -> bool:
        return self.spilled == 0


def compile_variant(dtype: str, kind: int, block_m: int, lse: bool, arch: int):
    """The compiled kernel of one variant (triton.compile's object), with the warps the
    worker launches it with."""
    names = paged_attention_kernel.arg_names
    kv = "*u8" if kind else f"*{dtype}"
    types = {"q_ptr": f"*{dtype}", "k_ptr": kv, "v_ptr": kv, "out_ptr": f"*{dtype}", "lse_ptr": "*fp32" if lse else f"*{dtype}",
             "table_ptr": "*i32", "tiles_ptr": "*i32", "scale_log2": "fp32", "v_scale": "fp32"}
    constants = {"BS": BLOCK_SIZE, "KVH": KV_HEADS, "HD": HEAD_DIM, "HD_P": HEAD_DIM, "GROUP": GROUP, "GROUP_P": 4, "BLOCK_M": block_m,
                 "TILE_N": TILE_N, "KV_KIND": kind, "WRITE_LSE": lse, "UPCAST": False}
    signature = {n: "constexpr" if n in constants else types.get(n, "i32") for n in names}
    constexprs = {(names.index(n),): v for n, v in constants.items()}
    options = {"num_warps": num_warps(dtype == "fp32", block_m)}
    return triton.compile(ASTSource(paged_attention_kernel, signature, constexprs), target=GPUTarget("cuda", arch, 32), options=options)


def ptxas_report(ptx: str, arch: int) -> tuple[int, int]:
    """(registers, spilled bytes) from the ptxas Triton's own compile used, for the PTX's target."""
    target = re.search(r"^\.target\s+(\S+)", ptx, re.MULTILINE).group(1).rstrip(",")
    ptxas = get_ptxas(arch).path
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "kernel.ptx"
        src.write_text(ptx)
        out = subprocess.run([str(ptxas), "-v", "--gpu-name", target, str(src), "-o", str(Path(d) / "kernel.cubin")],
                             capture_output=True, text=True, check=True).stderr
    registers = int(re.search(r"Used (\d+) registers", out).group(1))
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", out))
    return registers, spills


def compile_all(arch: int) -> list[Compiled]:
    found = []
    for name, dtype, kind, block_m, lse in VARIANTS:
        ptx = compile_variant(dtype, kind, block_m, lse, arch).asm["ptx"]
        registers, spilled = ptxas_report(ptx, arch)
        found.append(Compiled(name, registers, spilled, "wgmma.mma_async" in ptx or "mma.sync" in ptx))
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu.kernel_compile", description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability x 10 (default 90: H100, H200)")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        p.error("TRITON_INTERPRET=1 is set: the interpreter compiles nothing; unset it")
    print(f"triton {triton.__version__}, sm_{args.arch}")
    try:
        found = compile_all(args.arch)
    except Exception as e:  # noqa: BLE001 - the report is the point: say which failure, exit 1
        print(f"FAIL: the kernel does not compile: {type(e).__name__}: {e}")
        return 1
    for c in found:
        print(f"{c.name:28} {c.registers:4} registers  {c.spilled:5} bytes spilled  "
              f"{'tensor cores' if c.tensor_cores else 'FMA'}  {'ok' if c.ok else 'FAIL'}")
    return 0 if all(c.ok for c in found) else 1


if __name__ == "__main__":
    sys.exit(main())
