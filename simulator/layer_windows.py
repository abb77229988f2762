"""The simulator's hybrid KV-cache groups: a model's per-layer attention windows from
the command line, grouped as the server groups them (protocol.kv_cache_spec).

``--layer-windows 512x5,0 --num-layers 26``: the pattern (5 sliding layers of window
512, then a full one: Gemma 3's) repeated over 26 layers; or, as a Hugging Face config
says it, ``--sliding-window 512 --sliding-window-pattern 6 --num-layers 26`` (every 6th
layer full), or ``--model-config DIR`` (a checkpoint's config.json, read as the server
reads it: protocol.layer_windows). ``--disable-hybrid-kv-cache-manager``: one full-attention group (vLLM's
flag). A block then spans `num_kv_tensors` layers' KV: the pool's bytes buy
num_layers / num_kv_tensors times the blocks of an all-full model.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from protocol.kv_cache_spec import KVCacheGroupSpec, kv_cache_groups
from protocol.layer_windows import layer_windows


def parse_layer_windows(text: str) -> list[int]:
    """``W`` or ``WxN`` (N layers of window W), comma separated; 0 is full attention."""
    windows: list[int] = []
    for item in text.split(","):
        window, _, count = item.strip().partition("x")
        try:
            w, n = int(window), int(count or 1)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"--layer-windows: expected W or WxN items separated by commas, got {item!r}"
            ) from None
        if w < 0 or n < 1:
            raise argparse.ArgumentTypeError(
                f"--layer-windows: a window is >= 0 (0: full attention) and a count >= 1, got {item!r}"
            )
        windows += [w] * n
    return windows


def add_layer_window_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("hybrid KV-cache groups (sliding-window layers)")
    g.add_argument("--layer-windows", type=parse_layer_windows, default=None, metavar="SPEC",
                   help="each layer's attention window (W or WxN, comma separated; 0: full), repeated to --num-layers")
    g.add_argument(
        "--sliding-window",
        type=int,
        default=0,
        metavar="W",
        help="with --sliding-window-pattern: the sliding layers' window",
    )
    g.add_argument("--sliding-window-pattern", type=int, default=0, metavar="N",
                   help="every N-th layer is full attention, the others slide (Gemma 3: 6); 1: every layer full")
    g.add_argument(
        "--num-layers",
        type=int,
        default=0,
        metavar="L",
        help="the model's layers (with a window pattern)",
    )
    g.add_argument("--model-config", default=None, metavar="PATH",
                   help="a checkpoint's config.json, or its folder: every layer's window as the server reads it")
    g.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                   help="keep every layer's KV as full attention's (vLLM's flag): one group")


def layer_windows_from_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> list[int] | None:
    """Every layer's window, or None (no pattern given: one full-attention group, as before)."""
    if a.model_config is not None:
        if a.layer_windows is not None or a.sliding_window or a.sliding_window_pattern or a.num_layers:
            p.error("--model-config gives the layers' windows: not with --layer-windows, --sliding-window or --num-layers")
        return _config_windows(p, Path(a.model_config))
    if a.layer_windows is not None and (a.sliding_window or a.sliding_window_pattern):
        p.error("give --layer-windows or --sliding-window with --sliding-window-pattern, not both")
    if a.sliding_window or a.sliding_window_pattern:
        if a.sliding_window < 1 or a.sliding_window_pattern < 1:
            p.error("--sliding-window W and --sliding-window-pattern N go together, both >= 1")
        n = a.sliding_window_pattern
        pattern = [a.sliding_window] * (n - 1) + [0]
    elif a.layer_windows is not None:
        pattern = a.layer_windows
    else:
        if a.num_layers or a.disable_hybrid_kv_cache_manager:
            p.error(
                "--num-layers and --disable-hybrid-kv-cache-manager need --layer-windows or --sliding-window"
            )
        return None
    if a.num_layers < 0:
        p.error(f"--num-layers must be >= 0, got {a.num_layers}")
    num_layers = a.num_layers or len(pattern)
    return [pattern[i % len(pattern)] for i in range(num_layers)]


def group_windows_from_args(
    p: argparse.ArgumentParser, a: argparse.Namespace
) -> tuple[list[KVCacheGroupSpec], list[int]] | None:
    """(the groups, every layer's window) of the flags, or None for one full-attention group."""
    windows = layer_windows_from_args(p, a)
    if windows is None:
        return None
    try:
        return kv_cache_groups(windows, a.disable_hybrid_kv_cache_manager), windows
    except ValueError as e:
        p.error(str(e))


def _config_windows(p: argparse.ArgumentParser, path: Path) -> list[int]:
    """The windows of the model whose config.json is ``path`` (or is in the folder ``path``)."""
    if path.is_dir():
        path = path / "config.json"
    try:
        return layer_windows(json.loads(path.read_text()))
    except (OSError, ValueError) as e:
        p.error(f"--model-config {path}: {e}")
