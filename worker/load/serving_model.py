"""The model a worker serves: which checkpoint, in which dtype, for how long a
context, and its identity for the scheduler (``WorkerHello``).

Everything that can be wrong with a checkpoint is found here, before the worker says
hello: a ``CheckpointError`` or ``ModelConfigError`` naming the file, tensor or reason.
Under tensor parallelism a shard that cannot be cut (``ShardError``, a ModelConfigError)
is found before anything is loaded; then every rank checks with rank 0 that they serve
the same thing (``TPGroup.agree``: ``GroupError``) and loads only its shard.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from protocol.kv_cache_spec import KVCacheGroupSpec, kv_cache_groups
from worker.attention.kv_quant import KVScales
from worker.load.checkpoint import Checkpoint
from worker.models.config import DTYPES, ModelConfig, ModelConfigError, model_config_from_hf
from worker.models.decoder import DecoderModel
from worker.models.kv_scales import read_kv_scales
from worker.models.loader import load_model
from worker.parallel.distributed import TPGroup
from worker.parallel.linear import TPShard, plan_shard
from worker.tiny.generate import default_checkpoint


@dataclass(frozen=True, slots=True)
class ServingModel:
    model: DecoderModel
    config: ModelConfig
    directory: Path
    dtype: str  # resolved: never "auto"
    max_model_len: int
    identity: str  # hash of config.json and the weights' index
    load_seconds: float
    shard: TPShard | None = None  # this rank's part, under tensor parallelism
    # Per layer, an fp8 KV cache's scales (1.0 unless a quantized checkpoint has them).
    kv_scales: tuple[KVScales, ...] = ()
    # Each layer's attention window, 0 full (all 0 under --disable-sliding-window), and
    # the KV-cache groups of its layers (protocol.kv_cache_spec); (): one full group.
    layer_windows: tuple[int, ...] = ()
    kv_cache_groups: tuple[KVCacheGroupSpec, ...] = ()
    # On CUDA, the device's (free, total) bytes just before the weights loaded (vLLM's
    # init snapshot): the KV budget counts only what this process took since.
    memory_before_load: tuple[int, int] | None = None


def resolve_dtype(requested: str, config: ModelConfig) -> str:
    """``auto`` is the checkpoint's torch_dtype (as vLLM)."""
    return config.torch_dtype if requested == "auto" else requested


def check_max_model_len(config: ModelConfig, max_model_len: int | None, where: str, disable_sliding_window: bool = False) -> int:
    """The context served: the model's max_position_embeddings, or less. A sliding-window
    model is served past its window (its layers attend within it), except under
    --disable-sliding-window: then, as vLLM, every layer attends to all and the context
    is capped at the window."""
    n = config.max_position_embeddings if max_model_len is None else max_model_len
    if n > config.max_position_embeddings:
        raise ModelConfigError(f"{where}: max_model_len {n} is over the model's max_position_embeddings {config.max_position_embeddings}")
    window = config.sliding_window
    if disable_sliding_window and window is not None and n > window:
        if max_model_len is None:
            return window
        raise ModelConfigError(f"{where}: max_model_len {n} is longer than the model's sliding window {window} (--disable-sliding-window)")
    return n


def serving_windows(config: ModelConfig, disable_sliding_window: bool, disable_hybrid: bool) -> tuple[tuple[int, ...], tuple[KVCacheGroupSpec, ...]]:
    """Each layer's window and the KV-cache groups (vLLM: --disable-sliding-window makes
    every layer full attention; --disable-hybrid-kv-cache-manager keeps every layer's KV
    in one full group, the layers still attending within their windows)."""
    windows = (0,) * config.num_layers if disable_sliding_window else tuple(config.layer_windows)
    try:
        return windows, tuple(kv_cache_groups(windows, disable_hybrid))
    except ValueError as e:  # e.g. --disable-hybrid-kv-cache-manager over several window sizes, refused as by vLLM
        raise ModelConfigError(str(e)) from None


def check_shardable(model_dir: str | None, world_size: int) -> None:
    """ShardError (a ModelConfigError) if the model's heads cannot be split over
    ``world_size`` ranks: rank 0 checks before it starts the others."""
    ckpt = Checkpoint(Path(model_dir) if model_dir else default_checkpoint())
    where = str(ckpt.config_path)
    plan_shard(model_config_from_hf(ckpt.config, ckpt.generation_config, where), 0, world_size, where)


def load_serving_model(
    model_dir: str | None, dtype: str, device: str, max_model_len: int | None = None, group: TPGroup | None = None,
    block_size: int | None = None, kv_cache_dtype: str = "auto", disable_sliding_window: bool = False, disable_hybrid: bool = False,
) -> ServingModel:
    directory = Path(model_dir) if model_dir else default_checkpoint()
    t0 = time.perf_counter()
    ckpt = Checkpoint(directory)
    where = str(ckpt.config_path)
    config = model_config_from_hf(ckpt.config, ckpt.generation_config, where)
    if not config.eos_token_ids:
        raise ModelConfigError(f"{where}: no eos_token_id (in config.json or generation_config.json)")
    n = check_max_model_len(config, max_model_len, where, disable_sliding_window)
    windows, groups = serving_windows(config, disable_sliding_window, disable_hybrid)
    resolved = resolve_dtype(dtype, config)
    identity = ckpt.identity()
    shard = None
    if group is not None:
        # NOTE: the directory is not compared (hosts may mount it elsewhere); its identity is.
        # Agreement first, so that a rank started with another group size is named as such.
        group.agree({"world_size": group.world_size, "architecture": config.architecture, "model": identity,
                     "dtype": resolved, "max_model_len": n, "block_size": block_size, "device": torch.device(device).type,
                     "kv_cache_dtype": kv_cache_dtype, "kv_cache_groups": [[g.layer_ids, g.sliding_window] for g in groups],
                     "layer_windows": list(windows)})
        shard = plan_shard(config, group.rank, group.world_size, where)
    memory_before_load = torch.cuda.mem_get_info(torch.device(device)) if torch.device(device).type == "cuda" else None
    model = load_model(ckpt, DTYPES[resolved], torch.device(device), config, shard, None if group is None else group.all_reduce)
    kv_scales = tuple(read_kv_scales(ckpt, config.num_layers))
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    return ServingModel(model, config, directory, resolved, n, identity, time.perf_counter() - t0, shard, kv_scales, windows, groups,
                        memory_before_load)
