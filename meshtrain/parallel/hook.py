"""The sharding hook the models receive: a `Constrain` pins activations to a layout.

Models are written with logical axis names only. Where a model says how an activation
is laid out, it calls the hook it was given:

    constrain(x, axes) -> x     x pinned to the layout's activation spec for `axes`
    constrain.order(t)          positions [t] in the order a sequence is stored under
                                context parallelism (parallel/sequence.py), or None
    constrain.sharded           whether there is a mesh at all
    constrain.documents         the documents of a packed window (models/documents.py:
                                segment ids and positions [B, T], stored order), or None

`UNSHARDED` is the hook without a mesh (one device, tests, tracing shapes): it pins
nothing and stores sequences in position order. The models own no mesh: the kernels
XLA cannot split by itself (parallel/context_attention.py, parallel/experts.py,
parallel/sequence.py) take the hook and read its mesh and specs there. The step, the
pipeline's stages and the loss's chunks each make theirs, with the layout they see; a
task packing documents adds them (`with_documents`), and a pipeline stage gets its
microbatch's rows of them.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshtrain.parallel import sequence
from meshtrain.parallel.layouts.rules import Layout

Axes = tuple[str | None, ...]


class Constrain:
    def __init__(self, layout: Layout | None = None, mesh: Mesh | None = None, documents=None):
        """Both or neither: a layout on a mesh, or no sharding at all."""
        if (layout is None) != (mesh is None):
            raise ValueError("Constrain takes a layout and a mesh, or neither")
        self.layout, self.mesh, self.documents = layout, mesh, documents

    def with_documents(self, documents) -> "Constrain":
        """The same hook for a batch whose windows keep documents apart (or None)."""
        return Constrain(self.layout, self.mesh, documents)

    @property
    def sharded(self) -> bool:
        return self.mesh is not None

    def __call__(self, x: jax.Array, axes: Axes) -> jax.Array:
        if self.mesh is None:
            return x
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, self.spec(axes)))

    def spec(self, axes: Axes) -> PartitionSpec:
        """The layout's activation spec for `axes` (needs a mesh)."""
        return self.layout.spec(axes, "activations")

    def for_attention(self, axes: Axes) -> PartitionSpec:
        """The spec of `axes` with positions split only as attention splits them: the two
        differ under sequence parallelism (parallel/sequence.py)."""
        return sequence.for_attention(self.layout, axes)

    def order(self, t: int) -> np.ndarray | None:
        """Positions [t] in the layout's storage order, or None for 0..t-1."""
        return None if self.mesh is None else sequence.order(self.layout, self.mesh.shape, t)

    def mesh_size(self, axes: tuple[str, ...]) -> int:
        """Devices along `axes` of the mesh (1 without one)."""
        n = 1
        for a in axes if self.mesh is not None else ():
            n *= self.mesh.shape[a]
        return n


UNSHARDED = Constrain()
