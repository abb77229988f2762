"""A Hugging Face checkpoint directory on disk: its config files and its safetensors.

``config.json`` (required), ``generation_config.json`` (optional), and the weights:
one ``model.safetensors`` or shards listed by ``model.safetensors.index.json``. Tensors
are read with ``safetensors`` (memory-mapped; never pickle) straight to the target
device, then cast. Or one ``*.gguf`` file (the folder ``kvpool serve FILE.gguf`` writes
beside a GGUF), dequantized at load (``worker.load.gguf_weights``). Nothing is downloaded: a
checkpoint is a directory.

Every problem is a ``CheckpointError`` naming the file (and tensor) at fault.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from worker.load.gguf_weights import GGUFError, GGUFWeights

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file at fault."""


def read_json(path: Path, required: bool = True) -> dict | None:
    if not path.is_file():
        if required:
            raise CheckpointError(f"{path}: not found (a checkpoint directory needs config.json and *.safetensors)")
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


class Checkpoint:
    """The files of one checkpoint directory; ``tensor_files`` maps each tensor name
    to the safetensors file that holds it."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        if not self.dir.is_dir():
            raise CheckpointError(f"{self.dir}: not a checkpoint directory")
        self.config_path = self.dir / "config.json"
        self.gguf: GGUFWeights | None = None
        self.config = read_json(self.config_path)
        self.generation_config = read_json(self.dir / "generation_config.json", required=False)
        index_path = self.dir / INDEX_FILE
        if index_path.is_file():
            index = read_json(index_path)
            weight_map = index.get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{index_path}: no 'weight_map'")
            self.tensor_files = {name: self.dir / file for name, file in weight_map.items()}
            for path in sorted(set(self.tensor_files.values())):
                if not path.is_file():
                    raise CheckpointError(f"{path}: listed in {INDEX_FILE} but not found")
            self._index_bytes = index_path.read_bytes()
        elif not any(self.dir.glob("*.safetensors")) and (ggufs := sorted(self.dir.glob("*.gguf"))):
            self._open_gguf(ggufs)
        else:
            files = sorted(self.dir.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{self.dir}: no *.safetensors file (and no {INDEX_FILE})")
            if len(files) > 1:
                raise CheckpointError(f"{self.dir}: {len(files)} safetensors files but no {INDEX_FILE} to say which tensor is where")
            self.tensor_files = {name: files[0] for name in self._header(files[0])}
            self._index_bytes = json.dumps(self._header(files[0]), sort_keys=True).encode()

    def _open_gguf(self, files: list[Path]) -> None:
        if len(files) > 1:
            raise CheckpointError(f"{self.dir}: {len(files)} GGUF files; a checkpoint holds one")
        heads, kv_heads = self.config.get("num_attention_heads"), self.config.get("num_key_value_heads")
        try:
            self.gguf = GGUFWeights(files[0], heads, kv_heads or heads)
        except GGUFError as e:
            raise CheckpointError(str(e)) from None
        self.tensor_files = dict.fromkeys(self.gguf.tensors, files[0])
        self._index_bytes = self.gguf.index_bytes()

    @staticmethod
    def _header(path: Path) -> dict[str, list]:
        """{name: [dtype, shape]} from a safetensors header, checking the file is whole."""
        try:
            with safe_open(str(path), framework="pt") as f:
                return {k: [str(f.get_slice(k).get_dtype()), list(f.get_slice(k).get_shape())] for k in f.keys()}
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None

    def identity(self) -> str:
        """A hash of config.json and the weights' index (names, shapes, dtypes, files):
        two workers serve the same model only if their identities are equal."""
        h = hashlib.sha256()
        h.update(self.config_path.read_bytes())
        h.update(b"\0")
        h.update(self._index_bytes)
        return h.hexdigest()[:32]

    def load(
        self, names: list[str], dtype: torch.dtype, device: torch.device | str, narrow: dict[str, tuple[int, int, int]] | None = None
    ) -> dict[str, torch.Tensor]:
        """The named tensors, on ``device`` in ``dtype``. Names the checkpoint lacks are
        an error naming them; tensors it has beyond those are ignored.

        ``narrow`` maps a name to ``(dim, start, length)``: only that slice is read (a
        tensor-parallel rank's shard). ``self.shapes`` then holds every loaded tensor's
        whole shape, for the caller to check; a slice that does not fit the stored
        tensor is not taken (the whole tensor is returned, and its shape is wrong).
        """
        narrow = narrow or {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        missing = [n for n in names if n not in self.tensor_files]
        if missing:
            where = INDEX_FILE if (self.dir / INDEX_FILE).is_file() else self.tensor_files[next(iter(self.tensor_files))].name
            raise CheckpointError(f"{self.dir / where}: missing tensor {missing[0]!r}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        if self.gguf is not None:
            return self._load_gguf(names, dtype, device, narrow)
        by_file: dict[Path, list[str]] = {}
        for n in names:
            by_file.setdefault(self.tensor_files[n], []).append(n)
        out: dict[str, torch.Tensor] = {}
        device = str(device)
        for path, file_names in by_file.items():
            try:
                with safe_open(str(path), framework="pt", device=device) as f:
                    present = set(f.keys())
                    for n in file_names:
                        if n not in present:
                            raise CheckpointError(f"{path}: missing tensor {n!r} (the index says it is here)")
                        if n not in narrow:
                            out[n] = f.get_tensor(n).to(dtype)
                            self.shapes[n] = tuple(out[n].shape)
                            continue
                        sl = f.get_slice(n)
                        shape = self.shapes[n] = tuple(sl.get_shape())
                        dim, start, length = narrow[n]
                        if dim >= len(shape) or start + length > shape[dim]:
                            out[n] = f.get_tensor(n).to(dtype)
                            continue
                        index = (slice(None),) * dim + (slice(start, start + length),)
                        out[n] = sl[index].to(dtype)
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
        return out

    def _load_gguf(self, names: list[str], dtype: torch.dtype, device: torch.device | str,
                   narrow: dict[str, tuple[int, int, int]]) -> dict[str, torch.Tensor]:
        """``load`` from the GGUF file: each tensor dequantized whole, then narrowed."""
        out: dict[str, torch.Tensor] = {}
        for n in names:
            try:
                t = self.gguf.load(n, dtype, device)
            except GGUFError as e:
                raise CheckpointError(str(e)) from None
            shape = self.shapes[n] = tuple(t.shape)
            if n in narrow:
                dim, start, length = narrow[n]
                if dim < len(shape) and start + length <= shape[dim]:
                    t = t.narrow(dim, start, length)
            out[n] = t
        return out
