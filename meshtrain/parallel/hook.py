"""The hook for a layout on a mesh: `Constrain(layout, mesh)` answers what a model asks
of its layout (models/hook.py): pins, the sequence's storage order, and the kernels
written per device where GSPMD cannot split a computation by itself (context attention,
expert dispatch, sequence parallelism's gather; parallel/context_attention.py,
parallel/experts.py, parallel/sequence.py).

`Constrain()` (no layout, no mesh) is the models' `Hook`: nothing pinned or split. The
step, the pipeline's stages and the loss's chunks each make theirs, with the layout they
see; a task packing documents adds them (`with_documents`), and a pipeline stage gets
its microbatch's rows of them.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshtrain.models.hook import Axes, Hook
from meshtrain.parallel import context_attention, experts, sequence
from meshtrain.parallel.layouts.rules import Layout


class Constrain(Hook):
    def __init__(self, layout: Layout | None = None, mesh: Mesh | None = None, documents=None,
                 arrival: Callable | None = None):
        """Both or neither: a layout on a mesh, or no sharding at all. `arrival`: how a
        layer's parameters reach the device (parallel/offload.py), None where they are there."""
        if (layout is None) != (mesh is None):
            raise ValueError("Constrain takes a layout and a mesh, or neither")
        super().__init__(documents)
        self.layout, self.mesh, self.arrival = layout, mesh, arrival

    def with_documents(self, documents) -> "Constrain":
        return Constrain(self.layout, self.mesh, documents, self.arrival)

    @property
    def fetches(self) -> bool:
        return self.arrival is not None

    def arrive(self, params):
        return params if self.arrival is None else self.arrival(params)

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

    def order(self, t: int) -> np.ndarray | None:
        return None if self.mesh is None else sequence.order(self.layout, self.mesh.shape, t)

    def gather_sequence(self, x_btd: jax.Array) -> jax.Array:
        return x_btd if self.mesh is None else sequence.sequence_gather(x_btd, self.layout, self.mesh)

    def as_attention_sees(self, x: jax.Array, axes: Axes) -> jax.Array:
        return x if self.mesh is None else sequence.as_attention_sees(x, self.layout, self.mesh, axes)

    @property
    def splits_length(self) -> bool:
        """Whether the layout splits q's, k's and v's positions over devices (context
        parallelism): then attention runs in parallel/context_attention.py."""
        return self.sharded and sequence.split(self.layout, self.mesh.shape)[0] > 1

    def attend_split(self, q_bthe, k_btke, v_btke, kind: str) -> jax.Array:
        return context_attention.attend(q_bthe, k_btke, v_btke, kind=kind, layout=self.layout, mesh=self.mesh,
                                        documents=self.documents)

    def dispatch_experts(self, x_btd, e_btk, w_btk, ws, grouped) -> jax.Array:
        return experts.dispatch(x_btd, e_btk, w_btk, ws, self.layout, self.mesh, grouped)

