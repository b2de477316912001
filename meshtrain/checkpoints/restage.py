"""Moving a checkpoint between pipeline arrangements (none, or S stages x r repeats).

A pipelined run stores each block parameter, and its optimizer moments, as
[S, r*Lc, ...] (pipeline.to_stages); an unpipelined run stores [L, ...]. A checkpoint
saved under one arrangement is read in its own shapes, then restacked on device:

    saved [S', ...] --from_stages--> [L, ...] --to_stages--> [S, ...] current

The saved-shape arrays are placed like the current layout's arrays, with their
layer dims unsplit, so the read needs no host copy of the model; XLA moves layers
between stages while restacking, into the current shardings.
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from meshtrain.parallel.pipeline.scan import Pipeline, from_stages, to_stages


def arrangement(pipe: dict | Pipeline | None) -> tuple[int, int] | None:
    """(stages, repeats), or None when unpipelined; from a Pipeline or a checkpoint's meta."""
    if pipe is None:
        return None
    if isinstance(pipe, dict):
        return pipe["stages"], pipe["repeats"]
    return pipe.stages, pipe.repeats


def _in_stack(path, stacked: str) -> bool:
    """Whether a leaf lies under the model's stacked layers (ModelDef.stacked)."""
    return stacked is not None and any(getattr(k, "key", None) == stacked for k in path)


def _layer_dims(arr: tuple[int, int] | None) -> int:
    return 1 if arr is None else 2


def saved_target(target, current: tuple | None, saved: tuple | None, stacked: str):
    """`target` (abstract TrainState of this run) with stacked-layer leaves in the saved arrangement."""
    def one(path, leaf):
        if not _in_stack(path, stacked):
            return leaf
        inner = leaf.shape[_layer_dims(current):]
        layers = leaf.shape[0] * (leaf.shape[1] if current else 1)
        lead = (layers,) if saved is None else (saved[0], layers // saved[0])
        spec = tuple(leaf.sharding.spec) + (None,) * len(leaf.shape)
        sharding = NamedSharding(leaf.sharding.mesh, P(*(None,) * len(lead), *spec[_layer_dims(current):len(leaf.shape)]))
        return jax.ShapeDtypeStruct((*lead, *inner), leaf.dtype, sharding=sharding)
    return jax.tree_util.tree_map_with_path(one, target)


def restack(state, current: tuple | None, saved: tuple | None, shardings, stacked: str):
    """A restored TrainState in the saved arrangement -> the current one, in `shardings`."""
    def pipe(arr):
        return Pipeline(stages=arr[0], microbatches=1, repeats=arr[1])

    def one(path, x):
        if not _in_stack(path, stacked):
            return x
        layers = x if saved is None else from_stages(x, pipe(saved))
        return layers if current is None else to_stages(layers, pipe(current))
    return jax.jit(lambda s: jax.tree_util.tree_map_with_path(one, s), out_shardings=shardings)(state)
