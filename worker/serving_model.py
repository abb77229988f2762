"""The model a worker serves: which checkpoint, in which dtype, for how long a
context, and its identity for the scheduler (``WorkerHello``).

Everything that can be wrong with a checkpoint is found here, before the worker says
hello: a ``CheckpointError`` or ``ModelConfigError`` naming the file, tensor or reason.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from worker.checkpoint import Checkpoint
from worker.models.config import DTYPES, ModelConfig, ModelConfigError, model_config_from_hf
from worker.models.decoder import DecoderModel
from worker.models.loader import load_model
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


def resolve_dtype(requested: str, config: ModelConfig) -> str:
    """``auto`` is the checkpoint's torch_dtype (as vLLM)."""
    return config.torch_dtype if requested == "auto" else requested


def check_max_model_len(config: ModelConfig, max_model_len: int | None, where: str) -> int:
    n = config.max_position_embeddings if max_model_len is None else max_model_len
    if n > config.max_position_embeddings:
        raise ModelConfigError(f"{where}: max_model_len {n} is over the model's max_position_embeddings {config.max_position_embeddings}")
    if config.sliding_window is not None and n > config.sliding_window:
        raise ModelConfigError(
            f"{where}: the model uses sliding-window attention (window {config.sliding_window}), which kvpool does not "
            f"implement; it is served only with max_model_len <= {config.sliding_window} (asked: {n}; pass --max-model-len)"
        )
    return n


def load_serving_model(model_dir: str | None, dtype: str, device: str, max_model_len: int | None = None) -> ServingModel:
    directory = Path(model_dir) if model_dir else default_checkpoint()
    t0 = time.perf_counter()
    ckpt = Checkpoint(directory)
    where = str(ckpt.config_path)
    config = model_config_from_hf(ckpt.config, ckpt.generation_config, where)
    if not config.eos_token_ids:
        raise ModelConfigError(f"{where}: no eos_token_id (in config.json or generation_config.json)")
    n = check_max_model_len(config, max_model_len, where)
    resolved = resolve_dtype(dtype, config)
    model = load_model(ckpt, DTYPES[resolved], torch.device(device), config)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    return ServingModel(model, config, directory, resolved, n, ckpt.identity(), time.perf_counter() - t0)
