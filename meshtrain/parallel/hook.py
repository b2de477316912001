"""The `constrain(x, axes)` hook the models call: pins an activation to a layout."""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import Mesh, NamedSharding

from meshtrain.layouts import sequence
from meshtrain.layouts.rules import Layout


def make_constrain(layout: Layout, mesh: Mesh) -> Callable:
    """constrain(x, axes) -> x pinned to the layout's activation spec for `axes`. It also
    carries `mesh` and `spec(axes)`, for kernels GSPMD cannot split, which models run per
    device under shard_map (models/context_attention.py), `order(t)`, the order a sequence of
    t positions is stored in (None: natural), and `for_attention(axes)`, the spec with
    positions split only as attention splits them (both layouts/sequence.py). The step, the
    pipeline's stages and the loss's chunks (each with the layout they see) all make
    theirs here."""
    def constrain(x, axes):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, layout.spec(axes, "activations")))
    constrain.mesh = mesh
    constrain.spec = lambda axes: layout.spec(axes, "activations")
    constrain.order = lambda t: sequence.order(layout, mesh.shape, t)
    constrain.for_attention = lambda axes: sequence.for_attention(layout, axes)
    return constrain
