"""Reading and writing Hugging Face safetensors checkpoints one tensor at a time.

A model directory holds either `model.safetensors` or shards listed in
`model.safetensors.index.json` ({"weight_map": {tensor name: shard file}}). The reader
opens every shard with `safetensors.safe_open` (which maps the file and reads a header)
and copies out one tensor per `get`, so converting never holds more than the tensor at
hand besides what the caller keeps. Dtypes are kept as stored: bf16 comes back as
`ml_dtypes.bfloat16` numpy arrays.

The writer buffers tensors up to a shard size, writes each shard as it fills, and at
`close` names the shards `model-0000i-of-0000n.safetensors` and writes the index the
way `transformers.PreTrainedModel.save_pretrained` does (one file: `model.safetensors`,
no index).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, which safetensors' numpy reader needs)
import numpy as np

from meshtrain.errors import UserError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# transformers' default max_shard_size; a shard is written once it reaches this.
SHARD_BYTES = 5 * 2**30
# Bytes per element of safetensors' dtype names.
ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
            "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


class Reader:
    """Tensor name -> numpy array, from a directory's safetensors file(s)."""

    def __init__(self, directory: str | os.PathLike):
        from safetensors import safe_open
        self.dir = Path(directory)
        index = self.dir / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as e:
                raise UserError(f"{index} is not a safetensors index (a JSON object with a "
                                f"'weight_map'): {e}. Re-download or re-save the model.") from None
            files = sorted(set(weight_map.values()))
        elif (self.dir / SINGLE).is_file():
            files, weight_map = [SINGLE], None
        else:
            found = sorted(p.name for p in self.dir.glob("*"))[:12]
            raise UserError(
                f"{self.dir} has no {SINGLE} and no {INDEX} (it holds: {', '.join(found) or 'nothing'}). "
                f"Only safetensors weights are read: re-save the model with "
                f"`model.save_pretrained(DIR)` (safetensors is the default), or download its "
                f"*.safetensors files.")
        self._files = {}
        for name in files:
            path = self.dir / name
            if not path.is_file():
                raise UserError(f"{index} lists {name}, which is not in {self.dir}. Download "
                                f"every shard the index names.")
            self._files[name] = safe_open(str(path), framework="numpy")
        if weight_map is None:
            weight_map = {k: SINGLE for k in self._files[SINGLE].keys()}
        self._where = weight_map

    def keys(self) -> list[str]:
        return sorted(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._files[self._where[name]].get_slice(name).get_shape())

    def dtype_name(self, name: str) -> str:
        """The safetensors dtype, e.g. "BF16", "F32"."""
        return self._files[self._where[name]].get_slice(name).get_dtype()

    def nbytes(self, name: str) -> int:
        return int(np.prod(self.shape(name))) * ITEMSIZE.get(self.dtype_name(name), 4)

    def get(self, name: str) -> np.ndarray:
        """A copy of tensor `name`, in its stored dtype."""
        return self._files[self._where[name]].get_tensor(name)

    def close(self) -> None:
        for f in self._files.values():
            exit_ = getattr(f, "__exit__", None)
            if exit_ is not None:
                exit_(None, None, None)
        self._files = {}


class Writer:
    """Writes named tensors into safetensors shards of at most `shard_bytes` (one tensor
    larger than that gets a shard of its own)."""

    def __init__(self, directory: str | os.PathLike, shard_bytes: int = SHARD_BYTES):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.shard_bytes = shard_bytes
        self._pending: dict[str, np.ndarray] = {}
        self._pending_bytes = 0
        self._written: list[tuple[str, list[str]]] = []  # (temporary file name, tensor names)
        self.total_bytes = 0

    def add(self, name: str, array: np.ndarray) -> None:
        if name in self._pending or any(name in names for _, names in self._written):
            raise ValueError(f"tensor {name!r} written twice")
        array = np.ascontiguousarray(array)
        if self._pending and self._pending_bytes + array.nbytes > self.shard_bytes:
            self._flush()
        self._pending[name] = array
        self._pending_bytes += array.nbytes
        self.total_bytes += array.nbytes

    def _flush(self) -> None:
        from safetensors.numpy import save_file
        name = f".shard-{len(self._written):05d}.safetensors.tmp"
        save_file(self._pending, self.dir / name, metadata={"format": "pt"})
        # safetensors creates the file private (0600); a model directory is shared like any other.
        os.chmod(self.dir / name, 0o666 & ~_umask())
        self._written.append((name, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[str]:
        """Writes the last shard, names the shards, writes the index; returns the file names."""
        if self._pending or not self._written:
            self._flush()
        n = len(self._written)
        if n == 1:
            os.replace(self.dir / self._written[0][0], self.dir / SINGLE)
            (self.dir / INDEX).unlink(missing_ok=True)
            return [SINGLE]
        weight_map, names = {}, []
        for i, (tmp, tensors) in enumerate(self._written):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.dir / tmp, self.dir / final)
            weight_map.update({t: final for t in tensors})
            names.append(final)
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        (self.dir / SINGLE).unlink(missing_ok=True)
        return names


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
