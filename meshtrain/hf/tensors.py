"""Moving weights between Hugging Face's per-layer tensors and meshtrain's stacked leaves.

A family's converter (hf/gpt2.py, hf/llama.py, hf/mixtral.py) lists its weights as
`Tensor`s: the meshtrain leaf path, the Hugging Face name (with `{i}` for the layer of
a stacked leaf, and `{x}` for the expert of a leaf stacked [L, X, ...] from one tensor
per expert) and the two reshapes/transposes between them. `import_params` and
`export_params` walk that table one source tensor at a time:

  import: for each leaf, one [L, ...] output array; layer i's HF tensor is read,
          transformed and copied into row i (row [i, x] for expert x), then dropped.
  export: for each leaf, the stacked array is read; row i is transformed and handed
          to the safetensors writer (which writes a shard once it is full).

Two entries may read the same HF tensor (Mixtral's fused gate_up_proj holds two of our
leaves); such a table is for import only.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable

import numpy as np

from meshtrain.errors import UserError

Transform = Callable[[np.ndarray], np.ndarray]


def same(x: np.ndarray) -> np.ndarray:
    return x


@dataclasses.dataclass(frozen=True)
class Tensor:
    ours: str              # leaf path in the params dict, "blocks/attn/wq"
    hf: str                # Hugging Face name; "{i}" is the layer of a stacked leaf, "{x}" the expert
    to_ours: Transform = same  # one HF tensor -> one row (layer, or layer and expert) of ours
    to_hf: Transform = same    # the inverse
    experts: int = 0           # how many values "{x}" takes

    @property
    def stacked(self) -> bool:
        return "{i}" in self.hf

    def rows(self, num_layers: int) -> list[tuple[str, tuple[int, ...]]]:
        """(HF name, the index of its row in our leaf) for each tensor of this entry:
        () for an unstacked leaf, (i,) per layer, (i, x) per layer and expert."""
        if not self.stacked:
            return [(self.hf, ())]
        if "{x}" in self.hf:
            return [(self.hf.format(i=i, x=x), (i, x)) for i in range(num_layers) for x in range(self.experts)]
        return [(self.hf.format(i=i), (i,)) for i in range(num_layers)]

    def names(self, num_layers: int) -> list[str]:
        return [name for name, _ in self.rows(num_layers)]


class Progress:
    """One line per leaf: what, shape, dtype, size, time, and an ETA from bytes done."""

    def __init__(self, total_bytes: int, say: Callable[[str], None]):
        self.total, self.done, self.say = max(total_bytes, 1), 0, say
        self.start = time.perf_counter()

    def leaf(self, path: str, array: np.ndarray, nbytes: int) -> None:
        self.done += nbytes
        elapsed = time.perf_counter() - self.start
        eta = elapsed * (self.total - self.done) / max(self.done, 1)
        self.say(f"  {path:<28} {str(list(array.shape)):<24} {array.dtype.name:<8} "
                 f"{nbytes / 2**20:9.1f} MiB | {100 * self.done / self.total:5.1f}% "
                 f"{elapsed:6.1f}s elapsed, ETA {eta:5.1f}s")


def _some(names: list[str], shown: int = 5) -> str:
    """The first `shown` names, and how many more."""
    more = f" (and {len(names) - shown} more)" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def check_names(table: Iterable[Tensor], num_layers: int, available: Iterable[str],
                ignored: Callable[[str], bool], where: str, supported: str) -> None:
    """Every tensor the table needs is present, and nothing unknown is left over."""
    available = set(available)
    needed = [n for t in table for n in t.names(num_layers)]
    missing = [n for n in needed if n not in available]
    extra = sorted(n for n in available - set(needed) if not ignored(n))
    if missing:
        raise UserError(
            f"{where} lacks {len(missing)} of the {len(needed)} tensors the model needs: "
            f"{_some(missing)}. Its config.json describes a model whose "
            f"weights are not all there: download every safetensors file (and the index) "
            f"of the model. {supported}")
    if extra:
        raise UserError(
            f"{where} has tensors that meshtrain's model has no place for: "
            f"{_some(extra)}. Converting would silently drop them, so the "
            f"model would not be the one saved (biases or other layers we do not implement). "
            f"{supported}")


def import_params(table: list[Tensor], num_layers: int, get: Callable[[str], np.ndarray],
                  nbytes: Callable[[str], int], shapes: dict[str, tuple], say) -> dict:
    """{leaf path: array} for every table entry, each checked against `shapes` (the
    meshtrain model's leaf shapes). Keeps each tensor's stored dtype."""
    progress = Progress(sum(nbytes(n) for t in table for n in t.names(num_layers)), say)
    out = {}
    for t in table:
        rows = t.rows(num_layers)
        names = [name for name, _ in rows]
        want = tuple(shapes[t.ours])
        leaf = None
        for name, index in rows:
            x = get(name)
            try:
                y = t.to_ours(x)
                got = (*want[:len(index)], *y.shape)
            except ValueError:  # a reshape that does not fit
                y, got = None, "something else"
            if got != want:
                raise UserError(
                    f"Tensor {name} has shape {list(x.shape)}, which gives {t.ours} the shape "
                    f"{got if isinstance(got, str) else list(got)}, but config.json implies "
                    f"{list(want)}. config.json and the "
                    f"weights disagree: re-download or re-save the model.")
            if not t.stacked:
                leaf = np.ascontiguousarray(y)
                break
            if leaf is None:
                leaf = np.empty(want, y.dtype)
            elif y.dtype != leaf.dtype:
                raise UserError(f"Tensor {name} is {y.dtype.name} but layer 0's is "
                                f"{leaf.dtype.name}; mixed dtypes within a layer stack are not "
                                f"supported. Re-save the model in one dtype.")
            leaf[index] = y
        x = y = None  # before the next leaf's first read: one source tensor at a time
        out[t.ours] = leaf
        progress.leaf(t.ours, leaf, sum(nbytes(n) for n in names))
    return out


def export_params(table: list[Tensor], num_layers: int, read_leaf: Callable[[str], np.ndarray],
                  add: Callable[[str, np.ndarray], None], dtype, total_bytes: int, say) -> None:
    """Reads each leaf (`read_leaf(path)`, vocabulary padding already stripped) and hands
    its HF tensors, one layer at a time, to `add(name, array)`; casts to `dtype` if set."""
    progress = Progress(total_bytes, say)
    for t in table:
        leaf = read_leaf(t.ours)
        nbytes = 0
        for name, index in t.rows(num_layers):
            y = t.to_hf(leaf[index])
            if dtype is not None:
                y = y.astype(dtype)
            nbytes += y.nbytes
            add(name, y)
        progress.leaf(t.ours, leaf, nbytes)
        del leaf


def nbytes_of(shape, dtype) -> int:
    return math.prod(shape) * np.dtype(dtype).itemsize
