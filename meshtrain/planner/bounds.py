"""The least collective traffic a layout must send, by the formulas (nothing compiled): the
planner's bounds, set beside the compiled step's collectives (planner/report.py).

Collective lower bounds (bytes each device sends per step, ring algorithms):
  gradients    every leaf's gradient reduced once over the batch axes that do not shard it
               (a conv's leaves also over the axes that split image rows, and every leaf
               over the axes that split a sequence's positions: sums over positions, reduced
               there first, then 1/n of it over the batch axes):
               all-reduce 2 (n-1)/n x local bytes; over an axis that shards only its optimizer
               state (ZeRO-1) reduce-scatter then all-gather of the updated params, the same
               bytes, in the compute dtype (the narrowest the backward computes gradients
               in; norms kept in float32 send more, and say so), or in train.grad_dtype
               over the replica axes when it is set. ZeRO-2 sends the same bytes, but its
               reduce-scatter runs once per microbatch, and for the pipelined layers once
               per pipeline tick (r*M + S - 1 times a step): counted so.
  fsdp         weights sharded over an axis that also splits the batch: gathered for the
               forward and again for the backward pass of every microbatch, (n-1)/n x
               gathered bytes each in the compute dtype, and one reduce-scatter of the
               gradients, (n-1)/n x gathered bytes, per microbatch: ZeRO-3's 3 Psi (arXiv
               1910.02054 §7). With train.accum_gather=once: one gather per step before the
               microbatch loop and one reduce-scatter of the accumulated gradients after it.
               Under a pipeline, the tables outside it (embedding, head: split over stage)
               are gathered once per accumulation microbatch, the forward's copy serving
               the backward pass, and their gradients reduce-scattered as often.
  tensor       Megatron (arXiv 1909.08053): 2 all-reduces of [b, T, D] (T/n of a context split) per layer forward and
               2 backward per microbatch, plus, when the vocabulary is split, the embedding
               lookup forward and the output projection's input gradient backward, once per
               loss chunk (meshtrain/step/loss.py: n chunks send n all-reduces of [b, T/n, D]).
  stage        each microbatch crosses each stage boundary once forward and once backward,
               [b, T, D] in the compute dtype, (S-1)/S of the devices sending; r times round
               the stages under circular/interleaved: (r S - 1)/S per device.
  context      a layout that splits attention's positions: k and v round the ring
               forward and their gradients back, or all-gathered and reduce-scattered
               (planner/context.py; remat's recompute is known excess).
  experts      a layout that splits `experts`: each MoE layer's dispatch and combine
               all-to-alls, forward and backward (planner/experts.py; remat's rerun is known excess).
  halo         a layout that splits image rows: each conv's k//2 rows of its input forward
               and of its output gradient backward, each way at each split boundary
               (planner/halo.py; the weight gradient's second fetch of the input's rows is
               known excess). A classifier's channel tensor parallelism has no formula
               (`no_formula`), nor has the activation memory of a family without
               layer_activation_bytes.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from meshtrain import tree_paths
from meshtrain.planner import context, experts, halo
from meshtrain.planner.split_cost import SplitCost
from meshtrain.step import grad_reduce
from meshtrain.planner.analytic import (_axes_of, _embed_dim, _shards, _size, gathered, has_stream,
                                        local_batch, loss_chunks)


class _Rows:
    """The bound's rows by (kind, mesh axes): `add` sums counts and bytes into a row."""

    def __init__(self, mesh):
        self.mesh, self.rows = mesh, {}
        self.order = {a: i for i, a in enumerate(mesh.axis_names)}

    def add(self, kind, axes, count, nbytes, what) -> None:
        axes = tuple(sorted((a for a in axes if self.mesh.shape[a] > 1), key=self.order.get))
        if not axes or nbytes <= 0:
            return
        r = self.rows.setdefault((kind, axes), {"kind": kind, "mesh_axes": axes, "count": 0, "bytes": 0.0,
                                                "what": what})
        r["count"] += count
        r["bytes"] += nbytes

    def sorted(self) -> list[dict]:
        return sorted(self.rows.values(), key=lambda r: (r["mesh_axes"], r["kind"]))


# The splits that move activations their own way (planner/split_cost.py), by the plan
# report's key for their section, in its order.
SPLIT_COSTS: dict[str, SplitCost] = {"halo": halo, "context": context, "experts": experts}


def collective_bounds(exp) -> list[dict]:
    """[{kind, mesh_axes, count, bytes, what}]: the least each device must send per step
    (module docstring); `count` is how many ops the bound assumes."""
    rows = _Rows(exp.mesh)
    _gradients(exp, rows.add)
    for b in (b for cost in SPLIT_COSTS.values() if (t := cost.traffic(exp)) for b in t.bounds()):
        rows.add(b.kind, b.mesh_axes, b.count, b.bytes, b.what)
    if has_stream(exp.model):  # a classifier has no Megatron or pipeline formula (no_formula says so)
        _stream(exp, rows.add)
    return rows.sorted()


def _partial_sums(mesh, add, nbytes: float, rows_axes: list, split_axes: list) -> float:
    """A gradient summed over an image-row split, then over a sequence's split, before the
    batch axes see it: each all-reduce leaves 1/n of the bytes for the next. -> bytes left."""
    for axes, what in ((rows_axes, "conv gradient reduction over the row split"),
                       (split_axes, "gradient reduction over the context split")):
        if axes:
            n = _size(mesh, axes)
            add("all-reduce", axes, 0, 2 * (n - 1) / n * nbytes, what)
            nbytes /= n
    return nbytes


def _gradients(exp, add) -> None:
    """Each parameter's gradient reduction, ZeRO's reduce-scatter and gather, FSDP's
    gathers: per leaf, over the axes its batch split leaves it whole on."""
    m, mesh = exp.model, exp.mesh
    compute, pbytes = jnp.dtype(m.cfg.dtype).itemsize, jnp.dtype(m.cfg.param_dtype).itemsize
    b = local_batch(exp)
    _, batch_axes = _shards(exp, "batch")
    inner_axes = batch_axes if m.pipeline is None else _shards(exp, "batch", exp.layout.without("stage"))[1]
    grad_bytes = jnp.dtype(exp.cfg.train.grad_dtype).itemsize if exp.cfg.train.grad_dtype else 0
    once = gathered(exp)
    replicas = grad_reduce.replica_axes(exp.layout, mesh, exp.shardings.params, once)
    flat_shapes = tree_paths.flat(m.shapes)
    flat_params = tree_paths.flat(exp.shardings.params)
    flat_opt = tree_paths.flat(exp.grad_shardings)
    flat_axes = tree_paths.flat(m.axes, is_leaf=lambda x: isinstance(x, tuple))
    zero2 = exp.layout.splits_grads
    # A conv's gradient sums over the image rows too: a spatial split leaves a part on each device.
    convs, spatial = halo.conv_paths(exp), halo.spatial_axes(exp)
    positions = context.split(exp)[1]  # every weight's gradient is a sum over a split sequence's positions
    for path, shape in flat_shapes.items():
        p_axes, o_axes = _axes_of(flat_params[path]), _axes_of(flat_opt[path])
        splits = inner_axes if (m.pipeline is not None and path.startswith(m.stacked + "/")) else batch_axes
        local = math.prod(shape.shape) / _size(mesh, p_axes)
        g = compute  # the narrowest dtype gradients are computed in: a true lower bound
        rows_axes = [a for a in spatial if a not in p_axes] if path.startswith(convs) else []
        reduced = _partial_sums(mesh, add, local * g, rows_axes, [a for a in positions if a not in p_axes]) / g
        reduce_axes = [a for a in splits if a not in p_axes and mesh.shape[a] > 1]
        if grad_bytes and reduce_axes and set(reduce_axes) <= set(replicas):
            g = grad_bytes  # reduced by hand in train.grad_dtype (meshtrain/step/grad_reduce.py)
        zero = [a for a in reduce_axes if a in o_axes]
        plain = [a for a in reduce_axes if a not in o_axes]
        # Gradient reductions: XLA combines and splits them freely, so the bound counts no ops.
        if plain:
            n = _size(mesh, plain)
            add("all-reduce", plain, 0, 2 * (n - 1) / n * reduced * g, "gradient reduction")
        if zero:
            n = _size(mesh, zero)
            stage = "ZeRO-2" if zero2 else "ZeRO-1"
            times = 1
            if zero2:  # reduce-scattered where each microbatch's (each tick's) backward makes it
                ticks = m.pipeline.ticks if (m.pipeline is not None and path.startswith(m.stacked + "/")) else 1
                times = exp.cfg.train.grad_accum_steps * ticks
            add("reduce-scatter", zero, 0, times * (n - 1) / n * local * g, f"{stage} gradient reduce-scatter")
            add("all-gather", zero, 0, (n - 1) / n * local * pbytes, f"{stage} updated-param all-gather")
        owned = experts.owned_axes(path, flat_axes[path], flat_params[path])  # tokens go to the experts
        gather = [a for a in p_axes if a in splits and mesh.shape[a] > 1 and a not in owned]
        if gather and set(gather) <= set(once):  # train.accum_gather=once
            n = _size(mesh, gather)
            g = grad_bytes or g  # reduced by hand, in train.grad_dtype when set
            add("all-gather", gather, 0, (n - 1) * local * compute,
                "FSDP weight all-gather, once per step before the microbatch loop")
            add("reduce-scatter", gather, 0, (n - 1) * local * g,
                "FSDP reduce-scatter of the accumulated gradients, once per step")
        elif gather and m.pipeline is not None and not path.startswith(m.stacked + "/"):
            # the embedding and head under a pipeline (split over stage, fsdp): run once per
            # accumulation microbatch outside the ticks; backward reuses the forward's gather.
            # 1F1B's head splits vocab over stage as stored (pipeline_1f1b.head_layout).
            if m.pipeline.one_f_one_b and flat_axes[path] == ("embed", "vocab"):
                gather = [a for a in gather if a != "stage"]
            if not gather:
                continue
            n, k = _size(mesh, gather), exp.cfg.train.grad_accum_steps
            add("all-gather", gather, 0, k * (n - 1) * local * compute,
                "table outside the pipeline gathered once per microbatch (ZeRO-3 over stage)")
            add("reduce-scatter", gather, 0, k * (n - 1) * local * g,
                "its gradient reduce-scattered once per microbatch")
        elif gather:
            n = _size(mesh, gather)
            add("all-gather", gather, 0, 2 * b["micro"] * (n - 1) * local * compute,
                "FSDP weight all-gather, forward and backward, per microbatch (ZeRO-3)")
            add("reduce-scatter", gather, 0, exp.cfg.train.grad_accum_steps * (n - 1) * local * g,
                "FSDP gradient reduce-scatter, per microbatch")


def _stream(exp, add) -> None:
    """The residual stream's traffic: Megatron's all-reduces (and the vocab-parallel
    embedding's) over tensor, the pipeline's sends between stages."""
    m, cfg = exp.model, exp.model.cfg
    compute = jnp.dtype(cfg.dtype).itemsize
    b = local_batch(exp)
    t_axes = _shards(exp, "heads")[1]
    length = cfg.seq_len / context.split(exp)[0]  # the positions a device holds
    activation = b["pipeline_rows"] * length * _embed_dim(m) * compute
    stages = m.pipeline.stages if m.pipeline else 1
    if b["tensor"] > 1:
        n = b["tensor"]
        layers = cfg.num_layers // stages * b["micro"]
        add("all-reduce", t_axes, 4 * layers, 4 * layers * 2 * (n - 1) / n * activation,
            "Megatron: 2 all-reduces per layer forward, 2 backward")
        if b["vocab"] > 1:
            k, chunks = exp.cfg.train.grad_accum_steps, loss_chunks(exp)
            whole = b["rows"] * length * _embed_dim(m) * compute * k
            add("all-reduce", t_axes, (1 + chunks) * k, 2 * 2 * (n - 1) / n * whole,
                "vocab-parallel embedding: lookup forward, output projection backward per loss chunk")
    if stages > 1:  # r times round the ring under circular/interleaved: r S - 1 crossings
        r = m.pipeline.repeats
        add("collective-permute", ("stage",), 2 * b["micro"] * r,
            2 * b["micro"] * activation * (r * stages - 1) / stages,
            "pipeline: each microbatch over each stage boundary, forward and backward")
