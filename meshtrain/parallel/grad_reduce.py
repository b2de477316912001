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
rounding. With train.grad_accum_steps > 1 the per-replica gradients are accumulated in
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

ZeRO-2 (a layout whose `grads` table splits block parameters more than its `params`
table, parallel/layouts/rules.py) reduces inside the backward pass instead, layer by layer:
`pinned_in_backward` is an identity on one layer's params, applied inside the layer
scan, whose backward pins each gradient to the layer's `grads` spec, so XLA
reduce-scatters every layer's weight gradient where the scan's backward makes it and
the stacked gradient output [layers, ...] is split: no device holds it whole. Such a
layout has no replica axes in the sense above (its gradients are split over them), so
the per-replica path is not taken: with microbatches the split gradients are
accumulated, one reduce-scatter per microbatch, as in ZeRO-2; and train.grad_dtype is
refused (`check_layout`): the reduction happens at the weight-gradient matmul, in its
dtype, and a cast in the identity's backward comes after it (measured: an fp32 model's
reductions stayed fp32). The embeddings and the final norm are left to XLA, which
reduces them to the optimizer's shards where the backward pass makes them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from meshtrain.errors import UserError
from meshtrain.models.stack import run_stack
from meshtrain.parallel.hook import Constrain
from meshtrain.parallel.layouts import Layout
from meshtrain.parallel import compression, diloco
from meshtrain.parallel.layouts.rules import mesh_axes_of

GRAD_DTYPES = ("", "float32", "bfloat16")
ACCUM_GATHER = ("auto", "once", "each")


@dataclasses.dataclass(frozen=True)
class Reduction:
    """How the replicas' gradients are reduced, as the train.* keys say: `of(cfg.train,
    gather)` is the one place that reads them, and the step takes the result whole. A new
    way to reduce is a key in config.py, a field, its checks and its use here, and its cost
    in planner/bounds.py."""

    dtype: str = ""       # train.grad_dtype: "" reduces in the dtype the backward makes
    gather: str = "each"  # train.accum_gather, "auto" decided before the step is built: once | each
    # train.grad_compression over its axes (compression.resolve, once the replica axes are known)
    compression: compression.Compression | None = None

    @classmethod
    def of(cls, train, gather: str, comp: compression.Compression | None = None) -> "Reduction":
        return cls(dtype=train.grad_dtype, gather=gather, compression=comp)

    def by_hand(self, microbatches: int, has_stats: bool) -> bool:
        """Whether the step reduces over the replica axes itself (`per_replica`, `reduce`):
        for a dtype or a compression of its own, or once per step after accumulating
        microbatches (a model with BatchStat state leaves every microbatch's reduction to XLA)."""
        return bool(self.dtype) or self.compression is not None or (microbatches > 1 and not has_stats)

    def axes(self, layout: Layout, mesh: Mesh, param_shardings, microbatches: int,
             has_stats: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(gathered, replicas): the axes train.accum_gather=once gathers the params over
        (gathered_axes) and the replica axes the step reduces over by hand (() when XLA does)."""
        gathered = gathered_axes(layout, mesh, param_shardings, microbatches, self.gather)
        by_hand = self.by_hand(microbatches, has_stats)
        return gathered, (replica_axes(layout, mesh, param_shardings, gathered) if by_hand else ())


def of_run(train, gather: str, layout: Layout, mesh: Mesh, dcn: dict[str, int] | None, param_shapes,
           param_shardings, grad_dtypes, diloco_on: bool = False) -> Reduction:
    """The run's Reduction: train.grad_dtype, the gather mode (`gather`: "auto" decided)
    and train.grad_compression over its axes, which follow the replica axes of the
    reduction by hand (compression.resolve), its buckets cut from the gradients as they
    arrive (`grad_dtypes`, a leaf's in jax.tree.leaves order). Under DiLoCo (`diloco_on`)
    the compression is the outer step's (parallel/diloco.py), not the step's.
    train.compress_momentum is added by momentum_compression.with_momentum."""
    if train.grad_compression == "none" or diloco_on:
        return Reduction.of(train, gather)
    replicas = replicas_by_hand(layout, mesh, param_shardings, train.grad_accum_steps, gather)
    comp = compression.resolve(train, replicas, dcn, dict(mesh.shape))
    comp = dataclasses.replace(comp, cut=compression.buckets(comp, param_shapes, param_shardings, mesh, replicas,
                                                             grad_dtypes))
    return Reduction.of(train, gather, comp)


def state_shapes(reduction: Reduction, dil, inner_tx, param_shapes, param_shardings, moment_shardings,
                 mesh: Mesh, stacked: str | None = None) -> dict:
    """TrainState.comm's ShapeDtypeStructs: train.grad_compression's feedback buffers,
    DiLoCo's round (`dil`: the replicas' params and `inner_tx`'s state), or {}."""
    if dil is not None:
        return diloco.state_shapes(dil, inner_tx, param_shapes, param_shardings, moment_shardings, stacked)
    return compression.state_shapes(reduction.compression, mesh)


def describe(reduction: Reduction, replicas: tuple[str, ...], mesh_shape: dict[str, int],
             dil: diloco.Diloco | None = None, local_values: int = 0) -> str | None:
    """The start-up line on how the replicas' gradients meet where a key changed it from
    XLA's reduction in the backward's dtype (train.grad_dtype, train.grad_compression,
    train.compress_momentum, diloco.every); None where none did. `replicas`: the axes the
    step reduces over by hand (Reduction.axes). A compression's bytes are its two phases'
    between nodes (compression.wire, what the planner counts), against the same values in
    float32, which a cluster's two-level reduction would send; DiLoCo's, its outer steps'
    between islands over a round (diloco.wire of `local_values`, one device's values of a
    replica's params: every fragment meets once a round)."""
    if dil is not None:
        each = f"{dil.per_island} data replica{'s' if dil.per_island > 1 else ''} each"
        line = (f"DiLoCo, {dil.islands} islands ({each}): {dil.every} inner steps a "
                f"round with no collective between islands, then an outer Nesterov step (lr {dil.outer_lr:g}, "
                f"momentum {dil.outer_momentum:g})")
        if dil.fragments > 1:
            line += f", the layers in {dil.fragments} fragments meeting in turn"
        if dil.compress != "none":
            line += f", the pseudo-gradient {dil.compress} between islands"
        between = sum(nbytes for _, _, nbytes, _, in_node in diloco.wire(dil, local_values) if not in_node)
        return (f"gradients: {line}: {between:,.0f} bytes a device a round between islands "
                f"({between / dil.every:,.0f} a step)")
    comp = reduction.compression
    if comp is None:
        if reduction.dtype and replicas:
            return f"gradients: reduced over {'+'.join(replicas)} in {reduction.dtype}, once a step"
        return None
    cut = comp.cut
    between = sum(nbytes for _, axes, nbytes, _, in_node in compression.wire(comp, mesh_shape, replicas)
                  if axes == comp.axes and not in_node)
    float32 = 2 * (cut.k - 1) * 4 * cut.m
    where, unit = ((f"across {cut.k} nodes", "nodes") if comp.nodes > 1 else
                   (f"between all {cut.k} positions (no mesh.dcn)", "positions"))
    line = (f"gradients: {comp.kind} over {'+'.join(comp.axes)} {where}, error feedback "
            f"{'on' if comp.feedback else 'off'}: {between:,.0f} bytes a device a step between {unit}, "
            f"{between / float32:.3f} of float32's")
    if comp.momentum is not None:
        line += f"; the momentum compressed (1-bit Adam's form) after {comp.momentum.warmup} exact steps"
    return line


def replicas_by_hand(layout: Layout, mesh: Mesh, param_shardings, microbatches: int, gather: str) -> tuple[str, ...]:
    """The replica axes a reduction by hand sums over (those train.accum_gather=once
    gathers the params over included)."""
    return replica_axes(layout, mesh, param_shardings, gathered_axes(layout, mesh, param_shardings, microbatches, gather))


def check(train) -> None:
    """The keys alone (cfg.train)."""
    if train.grad_dtype not in GRAD_DTYPES:
        raise UserError(f"train.grad_dtype={train.grad_dtype!r}: choose bfloat16, float32, or \"\" to "
                        f"reduce gradients in the dtype the backward pass produces them in.")
    if train.accum_gather not in ACCUM_GATHER:
        raise UserError(f"train.accum_gather={train.accum_gather!r}: choose once (gather fsdp-sharded "
                        f"params once per step, reduce the accumulated gradients once), each (gather "
                        f"them in every microbatch), or auto (the planner's memory formula picks).")


def check_stats(train, has_stats: bool, family: str) -> None:
    """train.grad_dtype reduces per-replica gradients, whose forward passes would see only
    their replica's rows: BatchNorm's statistics would then differ from one device's."""
    if train.grad_compression != "none" and has_stats:
        raise UserError(
            f"train.grad_compression={train.grad_compression} with model.name={family!r}, whose BatchNorm "
            f"statistics are synchronised over the whole batch: the compressed reduction runs each data "
            f"replica's forward pass on its own rows, so the statistics would depend on the layout. Set "
            f"train.grad_compression=none, or model.batch_norm=false.")
    grad_dtype = train.grad_dtype
    if grad_dtype and has_stats:
        raise UserError(
            f"train.grad_dtype={grad_dtype!r} with model.name={family!r}, whose BatchNorm statistics "
            f"are synchronised over the whole batch: the hand-written reduction runs each data "
            f"replica's forward pass on its own rows, so the statistics (and the result) would "
            f"depend on the layout. Leave train.grad_dtype empty (XLA reduces the gradients), or "
            f"set model.batch_norm=false.")


def replica_axes(layout: Layout, mesh: Mesh, param_shardings, gathered: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Mesh axes (size > 1) that split the batch and no parameter, plus `gathered` (whose
    parameters the caller gathers first), in the batch's order: over these a gradient is
    a sum of whole, per-replica gradients. Axes the `grads` table splits gradients over in
    the backward pass (ZeRO-2) are never replica axes."""
    _, batch = layout.shards("batch", mesh.shape)
    used = _param_axes(param_shardings)
    # ZeRO-2: split over these in the backward pass (the `grads` table), never whole.
    used |= {a for _, axes in layout.grads for a in axes} if layout.splits_grads else set()
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


def per_replica(value_and_grad: Callable, axes: tuple[str, ...], mesh: Mesh, own_params: bool = False) -> Callable:
    """value_and_grad(params, stats, batch, key) -> (out, grads), built on the layout
    without the replica axes (`Layout.without(*axes)`), -> fn(params, stats, batch, key)
    -> (out [n, ...], grads [n, ...]), replica i on rows i*B/n .. (i+1)*B/n of every batch
    field, the rows its devices hold, and on params[i] when `own_params` (params [n, ...],
    DiLoCo's islands) else on the params all share."""
    n = math.prod(mesh.shape[a] for a in axes)
    split = NamedSharding(mesh, P(axes))

    def fn(params, stats, batch, key):
        rows = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(
            x.reshape(n, x.shape[0] // n, *x.shape[1:]), split), batch)
        keys = None if key is None else jax.random.split(key, n)
        return jax.vmap(value_and_grad, in_axes=(0 if own_params else None, None, 0, None if key is None else 0),
                        spmd_axis_name=axes)(params, stats, rows, keys)
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


def grads_pins(layout: Layout, mesh: Mesh, blocks_axes, lead: int):
    """blocks_axes-shaped tree: per block parameter, the NamedSharding of one layer's
    gradient under the `grads` table (its `lead` stacked dims, layers or stage and
    layers, dropped), or False where that is the params spec. None when every leaf is
    False: the layout keeps gradients where the weights are (every layout but ZeRO-2's)."""
    def spec(axes, target):
        return tuple(layout.spec(axes, target))[lead:]
    pins = jax.tree.map(lambda axes: NamedSharding(mesh, P(*spec(axes, "grads")))
                        if spec(axes, "grads") != spec(axes, "params") else False,
                        blocks_axes, is_leaf=lambda x: isinstance(x, tuple))
    return None if all(p is False for p in jax.tree.leaves(pins)) else pins


def pinned_in_backward(pins) -> Callable:
    """params -> params, an identity on one layer's params whose backward pins each
    gradient to its `pins` sharding (grads_pins). Applied inside the layer scan, XLA
    reduces each layer's weight gradient straight into that split where the backward
    pass makes it (a reduce-scatter per layer), and the scan's stacked output is split."""
    @jax.custom_vjp
    def pinned(params):
        return params

    def pin(g, sharding):
        return g if sharding is False else jax.lax.with_sharding_constraint(g, sharding)

    def bwd(_, grads):
        return (jax.tree.map(pin, grads, pins),)
    pinned.defvjp(lambda params: (params, None), bwd)
    return pinned


def constrain_both_ways(x: jax.Array, forward: NamedSharding, backward: NamedSharding) -> jax.Array:
    """with_sharding_constraint(x, forward), whose transpose pins the cotangent to
    `backward` instead: a constraint on weights (the compute-dtype cast, the pipeline's
    reshape) would otherwise gather a gradient the `grads` table keeps split."""
    if forward == backward:
        return jax.lax.with_sharding_constraint(x, forward)

    @jax.custom_vjp
    def pinned(x):
        return jax.lax.with_sharding_constraint(x, forward)
    pinned.defvjp(lambda x: (jax.lax.with_sharding_constraint(x, forward), None),
                  lambda _, g: (jax.lax.with_sharding_constraint(g, backward),))
    return pinned(x)


def sequential_runner(pins, constrain: Constrain, *, scan: bool) -> Callable:
    """run_layers(make_layer, stacked, x, key, documents) -> x (models/stack.py's runner seam): the
    layers in order, one key per layer as the model runs them itself, with
    `pinned_in_backward(pins)` on each layer's params inside the scanned body."""
    pinned = pinned_in_backward(pins)

    def run_layers(make_layer, stacked, x, key, documents=None):
        layer = make_layer(constrain.with_documents(documents))
        keys = None if key is None else jax.random.split(key, jax.tree.leaves(stacked)[0].shape[0])
        return run_stack(lambda x, params, k: layer(x, pinned(params), k), stacked, x, keys, scan=scan)
    return run_layers


def check_layout(train, layout: Layout) -> None:
    """train.grad_dtype needs whole per-replica gradients to reduce by hand; a layout that
    splits gradients inside the backward pass (ZeRO-2) has none."""
    if train.grad_compression != "none" and layout.splits_grads:
        raise UserError(
            f"train.grad_compression={train.grad_compression} with layout {layout.name!r}: this layout "
            f"reduce-scatters each layer's gradient inside the backward pass (ZeRO-2's grads table), so no "
            f"device holds a replica's whole gradient to compress. Use zero1 (the optimizer state split, "
            f"the gradient reduced once per step, compressed) or dp.")
    grad_dtype = train.grad_dtype
    if grad_dtype and layout.splits_grads:
        raise UserError(
            f"train.grad_dtype={grad_dtype!r} with layout {layout.name!r}: this layout reduce-scatters "
            f"each layer's gradient inside the backward pass (its grads table), where XLA reduces it "
            f"in the dtype the backward makes it in (model.dtype for matrices), so grad_dtype would "
            f"change nothing but round. Set train.grad_dtype=\"\" (with model.dtype=bfloat16 the "
            f"matrices' reductions are bfloat16 already), or use a layout without a grads table "
            f"(e.g. zero1) to reduce once per step in grad_dtype.")
