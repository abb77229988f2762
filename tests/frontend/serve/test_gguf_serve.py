"""``kvpool serve FILE.gguf``, as ``vllm serve FILE.gguf``: the real SmolLM2-135M-Instruct
GGUF (``make install`` brings it) served with the tokenizer from its own metadata, through
the OpenAI SDK: a chat answer that holds the fact asked for, and greedy continuations equal
to transformers' reading of the same file (float32); a GGUF kvpool cannot serve refused
before any process starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import openai
import pytest
import torch
from gguf import GGUFWriter
from kvtest.real_data import real_model
from kvtest.serve import kvpool_serve

REPO = Path(__file__).resolve().parents[3]
pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def real() -> Path:
    return real_model()


@pytest.fixture(scope="module")
def served(real, tmp_path_factory, _kvpool_cache_dir):
    with kvpool_serve(real, tmp_path_factory.mktemp("logs"), "--dtype", "float32", "--kv-cache-memory", "64MiB",
                      ready_timeout=180) as s:
        yield s


def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_chat_answer_holds_the_fact(served, real):
    answer = client(served).chat.completions.create(
        model=str(real), messages=[{"role": "user", "content": "Name the capital of France."}], max_tokens=24, temperature=0)
    assert "Paris" in answer.choices[0].message.content


def test_greedy_continuations_equal_transformers_reading_the_same_file(served, real):
    from transformers import AutoModelForCausalLM

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 49152, (int(n),), generator=gen).tolist() for n in torch.randint(4, 40, (6,), generator=gen)]
    model = AutoModelForCausalLM.from_pretrained(str(real.parent), gguf_file=real.name, dtype=torch.float32).eval()
    api = client(served)
    for p in prompts:
        got = api.completions.create(model=str(real), prompt=p, max_tokens=8, temperature=0, extra_body={"ignore_eos": True,
                                     "return_token_ids": True}).choices[0].token_ids
        ids, want = torch.tensor([p]), []
        with torch.inference_mode():
            for _ in range(8):
                want.append(int(model(ids).logits[0, -1].argmax()))
                ids = torch.cat([ids, torch.tensor([[want[-1]]])], dim=1)
        assert got == want


def test_a_gguf_it_cannot_serve_exits_2_naming_why_and_starts_nothing(tmp_path):
    w = GGUFWriter(str(tmp_path / "m.gguf"), "phi2")
    w.add_tensor("token_embd.weight", np.ones((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    p = subprocess.run([sys.executable, "-m", "frontend.serve.cli", "serve", str(tmp_path / "m.gguf"), "--log-dir", str(tmp_path / "logs")],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip().endswith("GGUF architecture 'phi2' is not served (kvpool serves llama, qwen2, qwen3, gemma3)")
    assert not (tmp_path / "logs").exists()
