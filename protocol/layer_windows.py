"""Each layer's attention window from a parsed Hugging Face ``config.json``, as
transformers 5 and vLLM 0.32 read it: 0 is full attention, W > 0 a sliding window of W
tokens (the token at position p attends to positions (p - W, p]).

One function for the worker (which attends within the windows and sizes its KV tensors
by the groups they make) and the ``kvpool serve`` launcher and simulator, which import
neither torch nor ``worker/``. The rules, first that applies:

1. ``layer_types`` (what transformers 5 writes for every model that has it): a
   ``sliding_attention`` layer has the config's window, a ``full_attention`` layer 0.
2. Gemma 3 (``gemma3_text``) without ``layer_types``: every ``sliding_window_pattern``-th
   layer (``_sliding_window_pattern`` as transformers 5 saves it; 6 by default) is full,
   the others slide.
3. Qwen2/Qwen3 (``max_window_layers``): layers from ``max_window_layers`` on slide when
   ``use_sliding_window`` (off by default), the first ones are full.
4. Otherwise (Mistral) every layer slides when ``sliding_window`` is set.

The window itself is ``sliding_window`` (transformers' default for the model type when
the key is absent); None or 0 means none (vLLM turns 0 into None), and Qwen's is off
unless ``use_sliding_window``: a sliding layer without a window attends to all.
"""

from __future__ import annotations

SLIDING, FULL = "sliding_attention", "full_attention"

# transformers' config classes' default ``sliding_window`` where config.json has no key.
_DEFAULT_WINDOW = {"gemma3_text": 4096, "mistral": 4096, "qwen2": 4096, "qwen3": 4096}
# Model types whose window is off unless ``use_sliding_window`` (transformers' default False).
_GATED = ("qwen2", "qwen3")


def config_window(cfg: dict) -> int:
    """The config's sliding window, 0 when it has none (or it is switched off)."""
    model_type = cfg.get("model_type", "")
    window = cfg.get("sliding_window", _DEFAULT_WINDOW.get(model_type))
    if not cfg.get("use_sliding_window", model_type not in _GATED):
        return 0
    if window is None:
        return 0
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"sliding_window must be a non-negative integer or null, got {window!r}")
    return window


def _int(cfg: dict, key: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{key} must be a non-negative integer, got {value!r}")
    return value


def layer_windows(cfg: dict) -> list[int]:
    """Per layer, its window (0: full attention). ValueError naming the key at fault."""
    num_layers = _int(cfg, "num_hidden_layers")
    window = config_window(cfg)
    types = cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != num_layers:
            raise ValueError(
                f"layer_types must list one type per layer ({num_layers}), got {types!r}"
            )
        unknown = sorted({t for t in types if t not in (SLIDING, FULL)}, key=str)
        if unknown:
            raise ValueError(
                f"layer_types {unknown} not supported (supported: {SLIDING!r}, {FULL!r})"
            )
        return [window if t == SLIDING else 0 for t in types]
    if cfg.get("model_type") == "gemma3_text":
        key = (
            "sliding_window_pattern"
            if "sliding_window_pattern" in cfg
            else "_sliding_window_pattern"
        )
        pattern = _int(cfg, key, 6)
        if pattern == 0:
            raise ValueError(f"{key} must be positive, got 0")
        return [window if (i + 1) % pattern else 0 for i in range(num_layers)]
    if "max_window_layers" in cfg:
        first = _int(cfg, "max_window_layers")
        return [window if i >= first else 0 for i in range(num_layers)]
    return [window] * num_layers
