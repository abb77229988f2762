"""``python -m bench gpu``, the CUDA host's one call: here, without CUDA, its dry run (every
step on the CPU at small sizes, saying first and last that no CUDA device is there); and
the figures its decode-step floor is made of."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.gpu.serve_check import compare, prompts_for, tier_prompts
from bench.gpu.shaped import smollm2_shaped_checkpoint
from bench.gpu.step_floor import copy_bandwidth, kv_bytes_attended, weight_bytes
from worker.load.checkpoint import Checkpoint
from worker.models.loader import load_model
from worker.tiny.generate import CONFIG

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is what a host without CUDA gets")
def test_without_cuda_the_call_says_so_and_dry_runs_every_step(tmp_path):
    out = tmp_path / "gpu"
    # NOTE: the real model's step left out: CI has no real model installed (where one is, it
    # adds a minute and changes nothing here).
    proc = subprocess.run([sys.executable, "-m", "bench", "gpu", "--out", str(out), "--skip", "real"], cwd=REPO, capture_output=True,
                          text=True, timeout=280)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert lines[0].startswith("NO CUDA DEVICE") and lines[-1].startswith("NO CUDA DEVICE")
    checks = {c["name"]: c for c in json.loads((out / "summary.json").read_text())}
    failed = [c for c in checks.values() if c["ok"] is False]
    assert not failed, failed
    # Every step ran: the tests collected, three served configurations (the host tier's passes
    # only with blocks loaded back from it), the step at three row counts for two models.
    assert checks["CUDA-marked tests collected (a dry run: they skip without CUDA)"]["ok"]
    assert {"serve tiny, float32, default cache", "serve tiny, float32, host tier", "serve tiny, float32, fp8 cache"} <= set(checks)
    assert sum(name.startswith("decode step, tiny") for name in checks) == 3
    assert sum(name.startswith("decode step, SmolLM2-shaped") for name in checks) == 3  # the real model's bytes, random weights
    # The whole log is in the folder, with pytest's and each server's.
    log = (out / "gpu-check.log").read_text()
    assert log.splitlines()[0].startswith("NO CUDA DEVICE") and "decode step, tiny, 16 rows" in log
    assert (out / "pytest-cuda.log").read_text().strip()
    assert len(list(out.glob("serve-tiny-*.log"))) == 3


def test_the_floor_reads_every_weight_once_and_the_kv_attended(tiny_checkpoint):
    model = load_model(Checkpoint(tiny_checkpoint), torch.bfloat16, "cpu")
    H, V, inter, layers = CONFIG["hidden_size"], CONFIG["vocab_size"], CONFIG["intermediate_size"], CONFIG["num_hidden_layers"]
    q, kv = CONFIG["num_attention_heads"] * CONFIG["head_dim"], CONFIG["num_key_value_heads"] * CONFIG["head_dim"]
    assert not CONFIG["tie_word_embeddings"]
    # Per layer: q, k, v, o, gate, up, down and two norms; then the final norm and the LM
    # head; the untied embedding table is read only at each row's token.
    per_layer = H * (q + 2 * kv) + q * H + 3 * H * inter + 2 * H
    assert weight_bytes(model) == 2 * (layers * per_layer + H + V * H)
    assert kv_bytes_attended(model, 3, 100, torch.float8_e4m3fn) == 3 * 100 * layers * 2 * kv
    assert copy_bandwidth(torch.device("cpu"), 1 << 20, repeats=2) > 0


def test_answers_are_compared_token_for_token():
    result = compare("x", [[1, 2, 3], [1, 2, 3], [1, 2]], [[1, 2, 3], [1, 5, 3], [1, 2, 3]])
    assert (result.equal, result.first_diff, result.ok) == (1, [-1, 1, 2], False)


def test_the_prompts_share_prefixes_where_the_checks_need_them():
    plain = prompts_for(512, 6)
    assert all(p[:48] == plain[1][:48] for p in plain[1::2]) and plain[0][:48] != plain[1][:48]
    tier = tier_prompts(512, 7)
    assert [p[:96] == tier[0][:96] for p in tier] == [True, False, False, True, False, False, True]
    assert all(len(p) == 100 and min(p) >= 2 for p in tier)


@pytest.mark.slow
def test_the_kernel_compiles_for_hopper_without_spills_tensor_cores_for_16_bit():
    """Triton's own compiler and ptxas (in its wheel), no GPU: what the interpreter cannot
    show (a kernel the compiler refuses, registers spilled) shows here."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "bench.gpu.kernel_compile", "--arch", "90"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith(("decode", "prefill"))]
    assert len(rows) == 10 and all(r.endswith(" ok") and " 0 bytes spilled" in r for r in rows)
    assert all("tensor cores" in r for r in rows if "bf16" in r or "fp16" in r)


def test_the_smollm2_shaped_checkpoint_has_the_real_models_shape(tmp_path):
    """The figures the issue names: 30 layers, hidden 576, 9 heads / 3 KV heads, vocabulary
    49,152, tied embeddings; about 135M parameters, 269 MB in bfloat16 read per step."""
    model = load_model(Checkpoint(smollm2_shaped_checkpoint(tmp_path / "s")), torch.bfloat16, "cpu")
    c = model.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.vocab_size, c.tie_word_embeddings) == (30, 576, 9, 3, 49152, True)
    assert 134e6 < weight_bytes(model) / 2 < 135e6
