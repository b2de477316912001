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
  tensor       Megatron (arXiv 1909.08053, `tensor_traffic`): 2 all-reduces of [b, T, D]
               (T/n of a context split) per layer forward and 2 backward per microbatch, plus,
               when the vocabulary is split, the embedding lookup forward and the output
               projection's input gradient backward, once per loss chunk
               (meshtrain/step/loss.py: n chunks send n all-reduces of [b, T/n, D]).
  stage        each microbatch crosses each stage boundary once forward and once backward
               (`stage_traffic`), [b, T, D] in the compute dtype, (S-1)/S of the devices
               sending; r times round the stages under circular/interleaved: (r S - 1)/S.
  context, experts, halo   k and v round the ring or gathered (planner/context.py), the MoE
               layers' all-to-alls (planner/experts.py), each conv's k//2 rows at each split
               boundary (planner/halo.py), forward and backward; what XLA sends beyond them
               for the model's reasons (remat's recompute, the weight gradient's second halo
               fetch) is known excess. A classifier's channel tensor parallelism has no
               formula (beyond_bounds.no_formula).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from meshtrain import tree_paths
from meshtrain.parallel import compression, diloco, grad_reduce
from meshtrain.planner import context, experts, halo
from meshtrain.planner.analytic import embed_dim, gathered, has_stream, loss_chunks, spec_axes
from meshtrain.planner.split_cost import SplitCost, Term, Traffic, group_size, local_batch, split_over


class _Rows:
    """The bound's rows by (kind, mesh axes): `add` sums counts and bytes into a row."""

    def __init__(self, mesh):
        self.mesh, self.rows = mesh, {}
        self.order = {a: i for i, a in enumerate(mesh.axis_names)}

    def add(self, kind, axes, count, nbytes, what, in_node: bool | None = False) -> None:
        """`in_node`: groups of the axes' positions inside one node (roofline.place keeps
        them off the network), as a hierarchical reduction's first and last phases; None:
        groups of one position a node (its phase across them)."""
        axes = tuple(sorted((a for a in axes if self.mesh.shape[a] > 1), key=self.order.get))
        if not axes or nbytes <= 0:
            return
        where = {"in_node": True} if in_node else {"across": True} if in_node is None else {}
        r = self.rows.setdefault((kind, axes, in_node), {"kind": kind, "mesh_axes": axes, "count": 0, "bytes": 0.0,
                                                         "what": what, **where})
        r["count"] += count
        r["bytes"] += nbytes

    def sorted(self) -> list[dict]:
        return sorted(self.rows.values(), key=lambda r: (r["mesh_axes"], r["kind"]))


def collective_bounds(exp) -> list[dict]:
    """[{kind, mesh_axes, count, bytes, what}]: the least each device must send per step
    (module docstring); `count` is how many ops the bound assumes."""
    rows = _Rows(exp.mesh)
    _gradients(exp, rows.add)
    for b in (b for cost in SPLIT_COSTS.values() if (t := cost.traffic(exp)) for b in t.bounds()):
        rows.add(b.kind, b.mesh_axes, b.count, b.bytes, b.what)
    return rows.sorted()


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One parameter as the bounds and their known excess (planner/beyond_bounds.py) read it."""

    path: str
    axes: tuple               # its logical axes
    params: tuple[str, ...]   # the mesh axes its params are split over
    opt: tuple[str, ...]      # and its optimizer state (ZeRO's reduce-scatter goes there)
    local: float              # its elements on a device
    rows: tuple[str, ...]     # the image-row split its gradient is summed over first (a conv's)
    positions: tuple[str, ...]  # the context split its gradient is summed over first (every leaf's)
    splits: tuple[str, ...]   # the batch axes its gradient is reduced over (a stage's, in the pipeline)
    stacked: bool             # in the pipelined layers
    sharding: object          # its params' NamedSharding


def leaves(exp):
    """Every parameter as a `Leaf`: the one walk over the parameters."""
    m, shape = exp.model, exp.mesh.shape
    batch_axes = split_over(exp.layout, shape, "batch")[1]
    inner_axes = batch_axes if m.pipeline is None else split_over(exp.layout.without("stage"), shape, "batch")[1]
    params, opt = tree_paths.flat(exp.shardings.params), tree_paths.flat(exp.grad_shardings)
    axes = tree_paths.flat(m.axes, is_leaf=lambda x: isinstance(x, tuple))
    # A conv's gradient sums over the image rows too: a spatial split leaves a part on each device.
    convs, spatial = halo.conv_paths(exp), halo.spatial_axes(exp)
    positions = context.split(exp)[1]  # every weight's gradient is a sum over a split sequence's positions
    for path, s in tree_paths.flat(m.shapes).items():
        p = spec_axes(params[path])
        stacked = m.pipeline is not None and path.startswith(m.stacked + "/")
        yield Leaf(path, tuple(axes[path]), p, spec_axes(opt[path]), math.prod(s.shape) / group_size(shape, p),
                   tuple(a for a in spatial if a not in p) if path.startswith(convs) else (),
                   tuple(a for a in positions if a not in p), inner_axes if stacked else batch_axes, stacked,
                   params[path])


def _partial_sums(shape, add, nbytes: float, leaf: Leaf) -> float:
    """A gradient summed over an image-row split, then over a sequence's split, before the
    batch axes see it: each all-reduce leaves 1/n of the bytes for the next. -> bytes left."""
    for axes, what in ((leaf.rows, "conv gradient reduction over the row split"),
                       (leaf.positions, "gradient reduction over the context split")):
        if axes:
            n = group_size(shape, axes)
            add("all-reduce", axes, 0, 2 * (n - 1) / n * nbytes, what)
            nbytes /= n
    return nbytes


def _gradients(exp, add) -> None:
    """Each parameter's gradient reduction, ZeRO's reduce-scatter and gather, FSDP's
    gathers: per leaf, over the axes its batch split leaves it whole on."""
    m, mesh, shape = exp.model, exp.mesh, exp.mesh.shape
    compute, pbytes = jnp.dtype(m.cfg.dtype).itemsize, jnp.dtype(m.cfg.param_dtype).itemsize
    k, micro = exp.cfg.train.grad_accum_steps, local_batch(exp)["micro"]
    grad_bytes = jnp.dtype(exp.cfg.train.grad_dtype).itemsize if exp.cfg.train.grad_dtype else 0
    once = gathered(exp)
    replicas = grad_reduce.replica_axes(exp.layout, mesh, exp.shardings.params, once)
    zero2 = exp.layout.splits_grads
    comp = exp.reduction.compression
    dil = getattr(exp, "diloco", None)
    for leaf in leaves(exp):
        local = leaf.local
        g = compute  # the narrowest dtype gradients are computed in: a true lower bound
        reduced = _partial_sums(shape, add, local * g, leaf) / g
        reduce_axes = [a for a in leaf.splits if a not in leaf.params]
        if grad_bytes and reduce_axes and set(reduce_axes) <= set(replicas):
            g = grad_bytes  # reduced by hand in train.grad_dtype (meshtrain/parallel/grad_reduce.py)
        zero = [a for a in reduce_axes if a in leaf.opt]
        plain = [a for a in reduce_axes if a not in leaf.opt]
        if comp and reduce_axes and set(reduce_axes) <= set(replicas):  # in the buckets (compression.wire, below)
            plain, zero = [], []
            if any(a in leaf.opt for a in reduce_axes):  # ZeRO-1: the update is split, its result gathered
                n = group_size(shape, [a for a in reduce_axes if a in leaf.opt])
                add("all-gather", [a for a in reduce_axes if a in leaf.opt], 0, (n - 1) / n * local * pbytes,
                    "ZeRO-1 updated-param all-gather")
        if dil and "data" in plain:  # DiLoCo: an island's mean inside the node (the rounds' below)
            plain = [a for a in plain if a != "data"]
            summed = 4 if k > 1 else g  # microbatches accumulate in float32
            add("all-reduce", ["data"], 0, 2 * (dil.per_island - 1) / dil.per_island * local * summed,
                "gradient mean inside an island (DiLoCo)", True)
        # Gradient reductions: XLA combines and splits them freely, so the bound counts no ops.
        if plain:
            n = group_size(shape, plain)
            add("all-reduce", plain, 0, 2 * (n - 1) / n * reduced * g, "gradient reduction")
        if zero:
            n = group_size(shape, zero)
            stage = "ZeRO-2" if zero2 else "ZeRO-1"
            # ZeRO-2 reduce-scatters where each microbatch's (each tick's) backward makes it
            times = k * (m.pipeline.ticks if leaf.stacked else 1) if zero2 else 1
            add("reduce-scatter", zero, 0, times * (n - 1) / n * local * g, f"{stage} gradient reduce-scatter")
            add("all-gather", zero, 0, (n - 1) / n * local * pbytes, f"{stage} updated-param all-gather")
        owned = experts.owned_axes(leaf.path, leaf.axes, leaf.sharding)  # tokens go to the experts
        gather = [a for a in leaf.params if a in leaf.splits and a not in owned]
        if gather and set(gather) <= set(once):  # train.accum_gather=once
            n = group_size(shape, gather)
            g = grad_bytes or g  # reduced by hand, in train.grad_dtype when set
            add("all-gather", gather, 0, (n - 1) * local * compute,
                "FSDP weight all-gather, once per step before the microbatch loop")
            add("reduce-scatter", gather, 0, (n - 1) * local * g,
                "FSDP reduce-scatter of the accumulated gradients, once per step")
        elif gather and m.pipeline is not None and not leaf.stacked:
            # the embedding and head under a pipeline (split over stage, fsdp): run once per
            # accumulation microbatch outside the ticks; backward reuses the forward's gather.
            # 1F1B's head splits vocab over stage as stored (schedule_1f1b.head_layout).
            if m.pipeline.one_f_one_b and leaf.axes == ("embed", "vocab"):
                gather = [a for a in gather if a != "stage"]
            if not gather:
                continue
            n = group_size(shape, gather)
            add("all-gather", gather, 0, k * (n - 1) * local * compute,
                "table outside the pipeline gathered once per microbatch (ZeRO-3 over stage)")
            add("reduce-scatter", gather, 0, k * (n - 1) * local * g,
                "its gradient reduce-scattered once per microbatch")
        elif gather:
            n = group_size(shape, gather)
            add("all-gather", gather, 0, 2 * micro * (n - 1) * local * compute,
                "FSDP weight all-gather, forward and backward, per microbatch (ZeRO-3)")
            add("reduce-scatter", gather, 0, k * (n - 1) * local * g,
                "FSDP gradient reduce-scatter, per microbatch")
    for kind, axes, nbytes, what, in_node in (compression.wire(comp, shape, replicas) if comp else []):
        add(kind, list(axes), 0, nbytes, what, in_node)
    if dil:  # the outer step's, once a round: a step's share
        for kind, axes, nbytes, what, in_node in diloco.wire(dil, sum(leaf.local for leaf in leaves(exp))):
            add(kind, list(axes), 0, nbytes / dil.every, f"{what}, once every {dil.every} steps (DiLoCo)",
                True if in_node else None)


def _stream(exp) -> tuple[dict, float] | None:
    """(local_batch, bytes of one row's [T/n, D] in the compute dtype, T/n the positions a
    device holds of a context split); None for a family without a residual stream (a
    classifier: beyond_bounds.no_formula names its tensor traffic)."""
    m = exp.model
    if not has_stream(m):
        return None
    return local_batch(exp), m.cfg.seq_len / context.split(exp)[0] * embed_dim(m) * jnp.dtype(m.cfg.dtype).itemsize


def tensor_traffic(exp) -> Traffic | None:
    """Megatron's all-reduces over the heads' mesh axes (module docstring), forward,
    backward and the vocabulary-parallel embedding's; None without a tensor split."""
    n, axes = split_over(exp.layout, exp.mesh.shape, "heads")
    stream = _stream(exp)
    if n == 1 or stream is None:
        return None
    (b, row), cfg, wire = stream, exp.model.cfg, 2 * (n - 1) / n
    layers = cfg.num_layers // (exp.model.pipeline.stages if exp.model.pipeline else 1) * b["micro"]
    what = "Megatron: 2 all-reduces per layer forward, 2 backward"
    out = Traffic(axes, n, ("all-reduce",))
    out.terms = {p: Term("all-reduce", 2 * layers * wire * b["pipeline_rows"] * row, 2 * layers, True, what)
                 for p in ("forward", "backward")}
    if b["vocab"] > 1:  # outside a pipeline, on the step's rows; the gradient per loss chunk
        k, chunks = exp.cfg.train.grad_accum_steps, loss_chunks(exp)
        out.terms["vocab"] = Term("all-reduce", 2 * wire * b["rows"] * row * k, (1 + chunks) * k, True,
                                  "vocab-parallel embedding: lookup forward, output projection backward per loss chunk")
    return out


def stage_traffic(exp) -> Traffic | None:
    """A pipeline's sends between stages (module docstring); None without a pipeline."""
    pipe, stream = exp.model.pipeline, _stream(exp)
    if pipe is None or pipe.stages == 1 or stream is None:
        return None
    (b, row), s, r = stream, pipe.stages, pipe.repeats
    sent = b["micro"] * b["pipeline_rows"] * row * (r * s - 1) / s
    what = "pipeline: each microbatch over each stage boundary, forward and backward"
    out = Traffic(("stage",), s, ("collective-permute",))
    out.terms = {p: Term("collective-permute", sent, b["micro"] * r, True, what) for p in ("forward", "backward")}
    return out


# Every split that moves activations (planner/split_cost.py), by its plan report section.
SPLIT_COSTS: dict[str, SplitCost] = {
    "tensor": SplitCost(tensor_traffic), "stage": SplitCost(stage_traffic), "halo": SplitCost(halo.traffic),
    "context": SplitCost(context.traffic, context.figures), "experts": SplitCost(experts.traffic, experts.figures)}
