"""Gradients reduced over the data-parallel replicas in a chosen dtype (train.grad_dtype).

Left to itself, XLA reduces a gradient where the backward pass produces it: a weight
gradient's matmul sums over the batch rows this device holds, and the all-reduce over
the data axis follows in that matmul's output dtype (the compute dtype: bfloat16 under
mixed precision, float32 otherwise). No sharding annotation moves a cast in front of
that all-reduce.

So with train.grad_dtype set, the step computes each replica's gradient separately and
does the reduction itself: the loss and its gradient are `vmap`ped over the replica axes
(`spmd_axis_name`, so replica i computes on its own devices), giving gradients
[n, ...] split over those axes, which are cast to grad_dtype and summed over n; the sum
of a split axis is the all-reduce (or, where the optimizer state is split over the axis,
ZeRO-1's reduce-scatter), now in grad_dtype. bfloat16 halves the bytes of a float32
reduction; float32 keeps a bfloat16 model's reduction exact beyond each replica's own
rounding. With train.microbatches > 1 the per-replica gradients are accumulated in
float32 over the microbatches and reduced once per step; this is also the path for
train.grad_dtype="" when there are microbatches, since XLA would otherwise all-reduce
every microbatch's gradient (k reductions a step, measured in tests/test_grad_dtype.py),
and then each gradient is reduced in the dtype the backward produces it in: the compute
dtype for matrices (step.make_cast), the param dtype for the rest.

The replica axes are the mesh axes the batch is split over and no parameter is (e.g.
`data`; not `fsdp`, whose gradients XLA reduce-scatters inside the backward pass).

train.accum_gather="once" makes the fsdp axes replica axes too, for the microbatch loop
(`gathered_axes`): the step gathers the parameters over them once, before the loop, and
the per-replica gradients accumulated over the microbatches are reduced once after it,
to the optimizer's sharding (a reduce-scatter over fsdp); "each" leaves them to XLA,
which gathers the weights and reduce-scatters their gradients in every microbatch.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from meshtrain.errors import UserError
from meshtrain.layouts import Layout
from meshtrain.layouts.rules import mesh_axes_of

GRAD_DTYPES = ("", "float32", "bfloat16")
ACCUM_GATHER = ("auto", "once", "each")


def check(grad_dtype: str, accum_gather: str = "auto") -> None:
    if grad_dtype not in GRAD_DTYPES:
        raise UserError(f"train.grad_dtype={grad_dtype!r}: choose bfloat16, float32, or \"\" to "
                        f"reduce gradients in the dtype the backward pass produces them in.")
    if accum_gather not in ACCUM_GATHER:
        raise UserError(f"train.accum_gather={accum_gather!r}: choose once (gather fsdp-sharded "
                        f"params once per step, reduce the accumulated gradients once), each (gather "
                        f"them in every microbatch), or auto (the planner's memory formula picks).")


def replica_axes(layout: Layout, mesh: Mesh, param_shardings, gathered: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Mesh axes (size > 1) that split the batch and no parameter, plus `gathered` (whose
    parameters the caller gathers first), in the batch's order: over these a gradient is
    a sum of whole, per-replica gradients."""
    _, batch = layout.shards("batch", mesh.shape)
    used = _param_axes(param_shardings)
    return tuple(a for a in batch if (a not in used or a in gathered) and mesh.shape[a] > 1)


def gathered_axes(layout: Layout, mesh: Mesh, param_shardings, microbatches: int, accum_gather: str) -> tuple[str, ...]:
    """The fsdp-like axes train.accum_gather="once" gathers once per step: mesh axes (size
    > 1) that split the batch and shard some parameter, except `stage` (its pipeline keeps
    each stage's weights apart). () when accum_gather is not "once", with one microbatch
    (nothing to save), or when no such axis exists: then "once" changes nothing."""
    if accum_gather != "once" or microbatches < 2:
        return ()
    _, batch = layout.shards("batch", mesh.shape)
    used = _param_axes(param_shardings)
    return tuple(a for a in batch if a in used and a != "stage" and mesh.shape[a] > 1)


def _param_axes(param_shardings) -> set[str]:
    return {a for s in jax.tree.leaves(param_shardings) for entry in s.spec for a in mesh_axes_of(entry)}


def per_replica(value_and_grad: Callable, axes: tuple[str, ...], mesh: Mesh) -> Callable:
    """value_and_grad(params, tokens [b, T+1], key) -> (loss, grads), built on the layout
    without the replica axes (`Layout.without(*axes)`), -> fn(params, tokens [B, T+1], key) -> (loss [n], grads [n, ...]), replica i
    on rows i*B/n .. (i+1)*B/n, the rows its devices hold."""
    n = math.prod(mesh.shape[a] for a in axes)
    split = NamedSharding(mesh, P(axes))

    def fn(params, tokens, key):
        b, t1 = tokens.shape
        rows = jax.lax.with_sharding_constraint(tokens.reshape(n, b // n, t1), split)
        keys = None if key is None else jax.random.split(key, n)
        return jax.vmap(value_and_grad, in_axes=(None, 0, None if key is None else 0),
                        spmd_axis_name=axes)(params, rows, keys)
    return fn


def reduce(grads_n, dtypes, param_dtypes) -> object:
    """grads [n, ...] (each replica's mean gradient) -> their mean, summed over the replica
    axes in `dtypes` (a dtype, or a tree of them) and returned in each parameter's dtype."""
    def one(g, dtype, like):
        # lax.reduce, not jnp.sum, which would widen a bfloat16 sum to float32 before
        # the reduction (and so before the all-reduce).
        total = jax.lax.reduce(g.astype(dtype), jnp.zeros((), dtype), jax.lax.add, (0,))
        return (total.astype(jnp.float32) / g.shape[0]).astype(like.dtype)
    if isinstance(dtypes, str):
        dtypes = jax.tree.map(lambda _: dtypes, grads_n)
    return jax.tree.map(one, grads_n, dtypes, param_dtypes)
