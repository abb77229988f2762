"""Marked ``compare`` (needs ``.venv-vllm``, selected with ``-m compare``): sliding-window
checkpoints through kvpool's paged path with per-group tables (``kvtest.grouped_paged``)
against vLLM 0.32 itself in float32: the same greedy tokens, their logprobs within 1e-4,
on prompts several windows long, two of them sharing a prefix. Gemma 3 (sliding and full
layers: vLLM's hybrid KV-cache manager) and Mistral with every layer sliding; vLLM refuses
Qwen2 with some layers full (``max_window_layers`` < layers)."""

from __future__ import annotations

import json
import random
import subprocess

import pytest
import torch
from kvtest.grouped_paged import GroupedPagedModel
from kvtest.hf_models import VOCAB, make_checkpoint

from bench.compare.servers import stop_process_group
from worker.load.checkpoint import Checkpoint
from worker.models.loader import load_model

BLOCK_SIZE, MAX_TOKENS = 16, 12


@pytest.mark.compare
@pytest.mark.parametrize("kind", ["gemma3", "mistral-sliding"])
def test_greedy_tokens_and_logprobs_equal_vllms(real_vllm, tmp_path, kind):
    path = make_checkpoint(kind, tmp_path / kind)
    rng = random.Random(1)
    shared = [rng.randrange(2, VOCAB) for _ in range(48)]
    prompts = [[rng.randrange(2, VOCAB) for _ in range(70)], shared + [rng.randrange(2, VOCAB) for _ in range(20)],
               shared + [rng.randrange(2, VOCAB) for _ in range(9)]]
    spec, result = tmp_path / "spec.json", tmp_path / "result.json"
    spec.write_text(
        json.dumps(
            {
                "model": str(path),
                "prompts": prompts,
                "max_tokens": MAX_TOKENS,
                "block_size": BLOCK_SIZE,
            }
        )
    )
    cmd = [
        str(real_vllm / ".venv-vllm/bin/python"),
        str(real_vllm / "tests/kvtest/vllm_greedy.py"),
        str(spec),
        str(result),
    ]
    with open(tmp_path / "vllm.log", "wb") as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1",
                             "PATH": "/usr/bin:/bin"}, start_new_session=True)
        try:
            rc = p.wait(600)
        finally:
            stop_process_group(p)
    assert rc == 0, (tmp_path / "vllm.log").read_text()[-3000:]
    vllm = json.loads(result.read_text())

    paged = GroupedPagedModel(
        load_model(Checkpoint(path), torch.float32, "cpu"), 128, BLOCK_SIZE, max_blocks=8
    )
    for sid, prompt in enumerate(prompts):
        paged.add(sid, prompt)
    paged.step({sid: len(prompt) for sid, prompt in enumerate(prompts)})
    for _ in range(MAX_TOKENS - 1):
        paged.step(dict.fromkeys(range(len(prompts)), 1))
    for sid, seq in paged.seqs.items():
        assert seq.out == vllm["outputs"][sid], f"seq {sid}"
        ours = [
            float(torch.log_softmax(logits.double(), -1)[t])
            for (_, logits), t in zip(seq.logits, seq.out, strict=True)
        ]
        assert ours == pytest.approx(vllm["logprobs"][sid], abs=1e-4), f"seq {sid}"
