"""The generated 50M Llama (``worker/tiny/llama50m.py``): its shape and parameter count read
back from the files, weights stored in bfloat16, kvpool's loader reads it, a paged
forward agrees with transformers' in float32, and writing it again gives the same bytes."""

from __future__ import annotations

import json
import random

import pytest
import torch
from kvtest.hf_models import load_reference, reference_logits
from kvtest.mini_scheduler import MiniScheduler
from safetensors import safe_open

from worker.kv.kv_cache import allocate_kv_caches
from worker.load.checkpoint import Checkpoint
from worker.models.loader import load_model
from worker.step.runner import ModelRunner
from worker.tiny import generate, llama50m

FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
NUM_BLOCKS = 32
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def llama50m_dir(_kvpool_cache_dir):
    return llama50m.llama50m_checkpoint()


def test_shape_and_parameter_count_from_the_files(llama50m_dir):
    c = json.loads((llama50m_dir / "config.json").read_text())
    assert (c["hidden_size"], c["num_attention_heads"], c["head_dim"], c["num_key_value_heads"]) == (768, 12, 64, 4)
    assert (c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]) == (2048, 8, 512)
    assert c["torch_dtype"] == "bfloat16" and c["tie_word_embeddings"] is False
    with safe_open(str(llama50m_dir / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert 50_000_000 < sum(t.numel() for t in tensors.values()) < 52_000_000
    assert tensors["lm_head.weight"].shape == (512, 768)  # its own tensor, not the embeddings
    assert tensors["model.layers.7.self_attn.k_proj.weight"].shape == (4 * 64, 768)


def test_in_the_cache_beside_the_tiny_one_with_its_tokenizer(llama50m_dir):
    assert llama50m_dir.name == "kvpool-llama50m-v1" and llama50m_dir.parent == generate.cache_dir()
    tiny = generate.default_checkpoint()
    assert (llama50m_dir / "tokenizer.json").read_bytes() == (tiny / "tokenizer.json").read_bytes()


def test_written_again_the_same_bytes(tmp_path, llama50m_dir):
    again = llama50m.write_llama50m_checkpoint(tmp_path / "again")
    for f in FILES:
        assert (again / f).read_bytes() == (llama50m_dir / f).read_bytes(), f


def test_paged_forward_agrees_with_transformers_in_float32(llama50m_dir):
    model = load_model(Checkpoint(llama50m_dir), torch.float32, "cpu")
    c = model.config
    assert (c.num_layers, c.num_kv_heads, c.head_dim) == (8, 4, 64)
    caches = allocate_kv_caches(c.num_layers, NUM_BLOCKS, BLOCK_SIZE, c.num_kv_heads, c.head_dim, torch.float32, "cpu")
    rng = random.Random(3)
    sched = MiniScheduler(ModelRunner(model, caches, 4, 128), rng, NUM_BLOCKS, BLOCK_SIZE)
    for sid in range(2):
        sched.add(sid, [rng.randrange(5, 512) for _ in range(rng.randint(20, 40))], 4)
    sched.run()
    hf = load_reference(llama50m_dir)  # float32 from the bfloat16 files: the same values
    for sid, req in sched.done.items():
        ref = reference_logits(hf, req.prompt + req.out)  # (T, V)
        for pos, logits in req.logits:
            scale = float(ref[pos].abs().max())
            torch.testing.assert_close(logits.double(), ref[pos], rtol=1e-4, atol=1e-4 * scale, msg=f"seq {sid} pos {pos}")
