"""What every task gives the core (tasks/__init__.py).

    batch_fields(cfg, rows) -> a pytree of Field: the arrays of a batch of `rows` examples
        (a bare Field for a single array), each with its logical axes; the leading dim
        of every field is `batch`
    units_per_example(cfg) -> how many throughput units one example is (tokens: seq_len)
    unit                   -> the name of that unit ("tokens", "images")
    flops(family)          -> the family's FLOPs-per-unit function (cfg -> training FLOPs)
    source_args(dims)      -> what make_source needs of the model's dims
      (these three are static methods: they are needed before the data exists)
    check_config(train, dims) -> raises UserError for train.* keys the task cannot take
    loss(module, batch, key, run_layers, *, constrain, layout, mesh, loss_chunk, train)
        -> (mean loss [], {metric: [] float32}): a bound model on a batch; `train` picks
        the model's training behaviour (BatchNorm's batch statistics)
    eval_metrics           -> the names of the metrics an eval step returns beside "loss"
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import jax
import numpy as np

from meshtrain.parallel.hook import Constrain


@dataclasses.dataclass(frozen=True)
class Field:
    """One array of a batch: its global shape, dtype and logical axes (leading `batch`)."""

    shape: tuple[int, ...]
    dtype: Any
    axes: tuple[str | None, ...]

    def struct(self, sharding=None) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(self.shape, np.dtype(self.dtype), sharding=sharding)


def is_field(x) -> bool:
    return isinstance(x, Field)


class Task(Protocol):
    name: str
    unit: str
    eval_metrics: tuple[str, ...]

    def batch_fields(self, cfg, rows: int) -> Any: ...

    def units_per_example(self, cfg) -> int: ...

    @staticmethod
    def flops(family) -> Callable: ...

    @staticmethod
    def source_args(dims: dict) -> dict: ...

    @staticmethod
    def check_config(train, dims: dict) -> None: ...

    def loss(self, module, batch, key, run_layers, *, constrain: Constrain, layout, mesh,
             loss_chunk: int, train: bool) -> tuple[jax.Array, dict[str, jax.Array]]: ...
