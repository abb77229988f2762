"""protocol/layer_windows.py: each layer's window, read from config.json as transformers
reads it. The reference is transformers' own config classes: the layer types they derive
(``layer_types``) from the same dict, with the window they keep."""

from __future__ import annotations

import pytest
import transformers as tf

from protocol.layer_windows import layer_windows


def transformers_windows(config) -> list[int]:
    types = getattr(config, "layer_types", None) or ["sliding_attention"] * config.num_hidden_layers
    window = getattr(config, "sliding_window", None) or 0
    return [window if t == "sliding_attention" else 0 for t in types]


# Configs as the Hub has them, without ``layer_types`` (written before transformers 5).
LEGACY = [
    ("gemma3_text", {"num_hidden_layers": 26, "sliding_window": 512, "sliding_window_pattern": 6}),
    ("gemma3_text", {"num_hidden_layers": 8, "sliding_window": 32, "sliding_window_pattern": 3}),
    ("gemma3_text", {"num_hidden_layers": 7, "sliding_window": 1024}),  # the default pattern, 6
    (
        "qwen2",
        {
            "num_hidden_layers": 6,
            "sliding_window": 64,
            "use_sliding_window": True,
            "max_window_layers": 2,
        },
    ),
    (
        "qwen2",
        {
            "num_hidden_layers": 6,
            "sliding_window": 32768,
            "use_sliding_window": False,
            "max_window_layers": 2,
        },
    ),
    (
        "qwen2",
        {"num_hidden_layers": 4, "sliding_window": 64, "max_window_layers": 0},
    ),  # off unless use_sliding_window
    (
        "qwen3",
        {
            "num_hidden_layers": 4,
            "sliding_window": 64,
            "use_sliding_window": True,
            "max_window_layers": 0,
        },
    ),
    ("mistral", {"num_hidden_layers": 3, "sliding_window": 4096}),
    ("mistral", {"num_hidden_layers": 3, "sliding_window": None}),
    ("llama", {"num_hidden_layers": 3}),
]
CLASSES = {"gemma3_text": tf.Gemma3TextConfig, "qwen2": tf.Qwen2Config, "qwen3": tf.Qwen3Config, "mistral": tf.MistralConfig,
           "llama": tf.LlamaConfig}


@pytest.mark.parametrize(("model_type", "cfg"), LEGACY)
def test_legacy_configs_as_transformers_reads_them(model_type, cfg):
    expected = transformers_windows(CLASSES[model_type](**cfg))
    assert layer_windows({"model_type": model_type, **cfg}) == expected


@pytest.mark.parametrize(("model_type", "cfg"), LEGACY)
def test_what_transformers_5_writes_reads_the_same(model_type, cfg):
    written = CLASSES[model_type](**cfg).to_dict()  # with layer_types where the class has them
    assert layer_windows(written) == transformers_windows(CLASSES[model_type](**cfg))


def test_figures_of_known_patterns():
    # Gemma 3 1B's config: 26 layers, every 6th full; Qwen2 with two full layers first.
    gemma = layer_windows(
        {
            "model_type": "gemma3_text",
            "num_hidden_layers": 26,
            "sliding_window": 512,
            "sliding_window_pattern": 6,
        }
    )
    assert [i for i, w in enumerate(gemma) if w == 0] == [5, 11, 17, 23] and set(gemma) == {0, 512}
    qwen = {
        "model_type": "qwen2",
        "num_hidden_layers": 4,
        "sliding_window": 8,
        "use_sliding_window": True,
        "max_window_layers": 2,
    }
    assert layer_windows(qwen) == [0, 0, 8, 8]
    # A window of 0 is none (vLLM turns 0 into None); explicit layer types win.
    assert layer_windows(
        {"model_type": "mistral", "num_hidden_layers": 2, "sliding_window": 0}
    ) == [0, 0]
    types = {
        "num_hidden_layers": 3,
        "sliding_window": 4,
        "layer_types": ["full_attention", "sliding_attention", "full_attention"],
    }
    assert layer_windows(types) == [0, 4, 0]


@pytest.mark.parametrize(
    ("cfg", "error"),
    [
        ({"num_hidden_layers": 2, "layer_types": ["full_attention"]}, "one type per layer"),
        (
            {"num_hidden_layers": 1, "layer_types": ["chunked_attention"]},
            "layer_types \\['chunked_attention'\\] not supported",
        ),
        ({"num_hidden_layers": 2, "sliding_window": -1}, "sliding_window must be"),
        ({"num_hidden_layers": 2, "sliding_window": "4k"}, "sliding_window must be"),
        ({}, "num_hidden_layers must be"),
        (
            {"model_type": "gemma3_text", "num_hidden_layers": 2, "sliding_window_pattern": 0},
            "sliding_window_pattern must be positive",
        ),
    ],
)
def test_bad_configs_are_named(cfg, error):
    with pytest.raises(ValueError, match=error):
        layer_windows(cfg)
