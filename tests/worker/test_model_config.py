"""worker/models/config.py for Gemma 3 and sliding windows: what a config.json says, in
the format transformers 5 writes and in the older one the Hub's Gemma 3 checkpoints have,
and what kvpool refuses by name."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf
from kvtest.grouped_paged import GroupedPagedModel
from kvtest.hf_models import VOCAB, load_reference, make_checkpoint, reference_logits

from worker.load.checkpoint import Checkpoint
from worker.models.config import ModelConfigError, Rope, model_config_from_hf
from worker.models.loader import load_model

# Gemma 3 4B's text config as the Hub has it (before transformers 5), shrunk.
HUB_GEMMA3 = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 256, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 12, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "query_pre_attn_scalar": 256, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window": 1024, "sliding_window_pattern": 6,
    "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": None, "attn_logit_softcapping": None,
    "eos_token_id": 1, "bos_token_id": 2, "max_position_embeddings": 131072,
}


def test_the_hub_gemma3_format():
    c = model_config_from_hf(HUB_GEMMA3)
    assert c.gemma and c.qk_norm and c.tie_word_embeddings and c.hidden_act == "gelu_pytorch_tanh"
    assert c.layer_windows == (1024,) * 5 + (0,) + (1024,) * 5 + (0,)
    assert c.rope == Rope(1_000_000.0, "linear", (("factor", 8.0),)) and c.local_rope == Rope(
        10_000.0, "default"
    )
    assert (
        c.attention_scale == 256**-0.5
        and c.final_logit_softcapping is None
        and c.sliding_window == 1024
    )


def test_what_transformers_5_writes_for_it_reads_the_same():
    hub = {k: v for k, v in HUB_GEMMA3.items() if k not in ("architectures", "model_type")}
    written = {**tf.Gemma3TextConfig(**hub).to_dict(), "architectures": ["Gemma3ForCausalLM"]}
    assert "layer_types" in written and "rope_parameters" in written and "rope_theta" not in written
    assert model_config_from_hf(written) == model_config_from_hf(HUB_GEMMA3)


def test_one_rope_when_no_layer_slides():
    c = model_config_from_hf({**HUB_GEMMA3, "sliding_window": None})
    assert c.layer_windows == (0,) * 12 and c.sliding_window is None and c.local_rope is None


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping is not supported"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"hidden_activation": "relu"}, "hidden_activation 'relu' is not supported"),
        (
            {"layer_types": ["sliding_attention"] * 3},
            "config.json: layer_types must list one type per layer \\(12\\)",
        ),
        (
            {"rope_parameters": {"full_attention": {"rope_type": "yarn"}, "sliding_attention": {}}},
            "full_attention: rope type 'yarn'",
        ),
    ],
)
def test_what_kvpool_cannot_serve_is_named(change, error):
    with pytest.raises(ModelConfigError, match=error):
        model_config_from_hf({**HUB_GEMMA3, **change})


def test_qwen2_and_mistral_windows():
    base = {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
    }
    qwen = {
        **base,
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "sliding_window": 32,
        "max_window_layers": 1,
    }
    assert model_config_from_hf(qwen).layer_windows == (0, 0, 0)  # off unless use_sliding_window
    assert model_config_from_hf({**qwen, "use_sliding_window": True}).layer_windows == (0, 32, 32)
    mistral = {
        **base,
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "sliding_window": 32,
    }
    c = model_config_from_hf(mistral)
    assert (
        c.layer_windows == (32, 32, 32)
        and c.local_rope is None
        and c.attention_scale is None
        and not c.gemma
    )


def test_final_logit_softcapping_as_transformers(tmp_path):
    # Gemma 3 sets none; Gemma 2 and others cap the logits: logits = cap * tanh(logits / cap).
    # NOTE: this model's uncapped logits reach past 10, so an ignored cap cannot match.
    path = make_checkpoint("gemma3-tied", tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "final_logit_softcapping": 2.0}))
    prompt = [(7 * i) % (VOCAB - 2) + 2 for i in range(40)]
    paged = GroupedPagedModel(load_model(Checkpoint(path), torch.float32, "cpu"), 64, 4)
    paged.add(0, prompt)
    paged.step({0: len(prompt)})
    ((pos, logits),) = paged.seqs[0].logits
    ref = reference_logits(load_reference(path), prompt)[pos]
    torch.testing.assert_close(logits.double(), ref, rtol=1e-4, atol=1e-4)
    assert float(logits.abs().max()) <= 2.0
