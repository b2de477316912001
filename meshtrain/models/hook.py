"""What a model asks of the layout it runs under: the hook every model call receives.

Models are written with logical axis names only and own no mesh. Where a model says how
an activation is laid out, or needs work that only the layout can split, it asks the hook
it was handed:

    hook(x, axes) -> x              x pinned to the layout's activation spec for `axes`
    hook.order(t)                   positions [t] in the order a sequence is stored under
                                    context parallelism, or None for 0..t-1
    hook.gather_sequence(x_btd)     attention's or the MLP's input, whole in positions
                                    where sequence parallelism splits the stream
    hook.as_attention_sees(x, axes) x pinned with its positions split as attention splits them
    hook.splits_length              whether attention's positions are split over devices;
    hook.attend_split(q, k, v, kind)  ...then causal attention over the pieces
    hook.dispatch_experts(...)      the tokens sent to their experts' devices and back
    hook.arrive(params)             one layer's parameters as its layer reads them: fetched
                                    from host memory under train.offload=params (`fetches`)
    hook.sharded                    whether there is a mesh at all
    hook.documents                  the documents of a packed window (models/documents.py:
                                    segment ids and positions [B, T], stored order), or None

`Hook` itself is the answer without a mesh (one device, tests, tracing shapes): it pins
nothing, stores sequences in position order and never splits. `parallel/hook.py`'s
`Constrain` answers for a layout on a mesh; the models never import it, so the
parallelisms live above the models (parallel/), as torchtitan's `distributed/` sits above
its models.
"""

from __future__ import annotations

import jax
import numpy as np

Axes = tuple[str | None, ...]


class Hook:
    sharded = False
    splits_length = False
    fetches = False

    def __init__(self, documents=None):
        self.documents = documents

    def with_documents(self, documents) -> "Hook":
        """The same hook for a batch whose windows keep documents apart (or None)."""
        return Hook(documents)

    def __call__(self, x: jax.Array, axes: Axes) -> jax.Array:
        return x

    def order(self, t: int) -> np.ndarray | None:
        return None

    def arrive(self, params):
        """One layer's parameters (a dict of arrays without the layers dim) as the layer
        reads them, inside its remat: as they are, or fetched from host memory."""
        return params

    def gather_sequence(self, x_btd: jax.Array) -> jax.Array:
        return x_btd

    def as_attention_sees(self, x: jax.Array, axes: Axes) -> jax.Array:
        return x

    def attend_split(self, q_bthe, k_btke, v_btke, kind: str) -> jax.Array:
        """Causal attention when `splits_length`: -> [B, T, H, E]."""
        raise NotImplementedError("attention over a split sequence needs a layout on a mesh")

    def dispatch_experts(self, x_btd, e_btk, w_btk, ws, grouped) -> jax.Array:
        """x [B, T, D], expert ids and weights [B, T, k], the experts' weights `ws` ->
        [B, T, D] on a mesh; `grouped` is the per-device compute (models/moe_dropless.py)."""
        raise NotImplementedError("expert dispatch over devices needs a layout on a mesh")


UNSHARDED = Hook()
