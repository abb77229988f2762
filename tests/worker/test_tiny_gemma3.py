"""The generated Gemma-3-style checkpoint: the same files every time, transformers reads
its config as Gemma 3's (5 sliding : 1 full, local and global RoPE bases) and runs it in
float32 with a real 128-token window; the default checkpoint is not touched."""

from __future__ import annotations

import pytest

from protocol.kv_cache_spec import kv_cache_groups, num_kv_tensors
from worker.tiny import gemma3, generate

FILES = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
]


@pytest.fixture(scope="module")
def gemma3_dir():
    return gemma3.gemma3_checkpoint()


def test_written_again_the_same_files_beside_the_default_checkpoint(tmp_path, gemma3_dir):
    again = gemma3.write_gemma3_checkpoint(tmp_path / "again")
    for f in FILES:
        assert (again / f).read_bytes() == (gemma3_dir / f).read_bytes(), f
    assert gemma3_dir.name == "kvpool-tiny-gemma3-v1" and gemma3_dir.parent == generate.cache_dir()
    assert generate.NAME == "kvpool-tiny-llama-v1" and generate.CONFIG["architectures"] == [
        "LlamaForCausalLM"
    ]
    # the same tokenizer as the tiny Llama's
    assert (gemma3_dir / "tokenizer.json").read_bytes() == (
        generate.default_checkpoint() / "tokenizer.json"
    ).read_bytes()


def test_its_layers_make_six_kv_cache_groups_of_one_layer():
    windows = [128 if t == "sliding_attention" else 0 for t in gemma3.CONFIG["layer_types"]]
    assert windows == [128, 128, 128, 128, 128, 0]
    groups = kv_cache_groups(windows)
    # vLLM's rule: 5 sliding and 1 full layer -> groups of 1 layer, one KV tensor
    assert [(g.layer_ids, g.sliding_window) for g in groups] == [
        ([0], 128),
        ([1], 128),
        ([2], 128),
        ([3], 128),
        ([4], 128),
        ([5], 0),
    ]
    assert num_kv_tensors(groups) == 1


def test_transformers_reads_it_as_gemma3_and_the_window_is_real(gemma3_dir):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    c = AutoConfig.from_pretrained(str(gemma3_dir))
    assert type(c).__name__ == "Gemma3TextConfig"
    assert (
        c.layer_types == ["sliding_attention"] * 5 + ["full_attention"] and c.sliding_window == 128
    )
    assert c.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
    assert c.rope_parameters["full_attention"]["rope_theta"] == 1000000.0
    assert c.query_pre_attn_scalar == 16 and c.head_dim == 32 and not c.tie_word_embeddings

    m = AutoModelForCausalLM.from_pretrained(
        str(gemma3_dir), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    assert type(m).__name__ == "Gemma3ForCausalLM"
    ids = torch.randint(5, 512, (1, 160), generator=torch.Generator().manual_seed(0))

    def logits(window: int) -> torch.Tensor:
        m.config.sliding_window = (
            window  # NOTE: transformers builds the masks from it every forward
        )
        with torch.no_grad():
            return m(ids).logits[0]

    windowed, unbounded = logits(128), logits(100_000)
    assert windowed.dtype == torch.float32 and torch.isfinite(windowed).all()
    # inside the window both attend to the same keys; past it the sliding layers see less
    torch.testing.assert_close(windowed[:128], unbounded[:128], rtol=0, atol=1e-5)
    assert (windowed[128:] - unbounded[128:]).abs().amax(-1).min() > 1e-2
    # greedy picks move with the window: the context matters to this checkpoint
    assert (windowed[128:].argmax(-1) != unbounded[128:].argmax(-1)).float().mean() > 0.5
