"""Collective traffic the planner's bounds (bounds.collective_bounds) do not count, set
beside the compiled program's in the report:

  known_excess  what the layout's program sends beyond the bound for reasons of the model's
                own making (a tied table reduced twice, conv gradients under a row split,
                halo rows fetched again, kv heads kept whole), counted in bytes
  no_formula    mesh axes whose traffic has no formula at all (a classifier's channel
                tensor parallelism): reported without a bound
"""

from __future__ import annotations

import jax.numpy as jnp

from meshtrain.planner import analytic
from meshtrain.planner.bounds import SPLIT_COSTS, leaves
from meshtrain.planner.split_cost import group_size, split_over


def no_formula(exp) -> list[dict]:
    """[{mesh_axes, why}]: traffic of the layout the bounds do not count. A model without a
    [batch, length, embed] stream (a classifier) has no formula for tensor parallelism
    (channel-split convs and classifier) or pipelines: its tensor-axis collectives are
    reported without a bound."""
    m, mesh = exp.model, exp.mesh
    if analytic.has_stream(m):
        return []
    names = ("filters", "channels", "mlp", "embed", "vocab", "heads")
    axes = tuple(dict.fromkeys(a for n in names for a in split_over(exp.layout, mesh.shape, n)[1]))
    if not axes:
        return []
    return [{"mesh_axes": axes, "why": f"no formula for the collectives of a classifier's feature maps "
                                       f"split over {'+'.join(axes)} (channel tensor parallelism): not in the bound"}]


def known_excess(exp) -> list[dict]:
    """Traffic the layout's program sends beyond the bound for reasons of the model's own
    making: [{kind, mesh_axes, bytes, why}].

      tied table   a [vocab, embed] table with no [embed, vocab] output matrix serves the
                   lookup and the output projection; XLA reduces the two gradient pieces
                   over the batch axes before adding them, so the table's reduction runs twice
      conv grads   under a row split, XLA all-reduces a conv's gradient over the split,
                   then whole over the batch axes: (1 - 1/r) of the latter is more than
                   the bound's (a reduce-scatter over the split first)
      halo         the weight gradient's halo rows, fetched again (planner/halo.py)
      context      the same for every leaf under a context split; and remat's recompute of
                   context attention's k and v exchange (planner/context.py)
      experts      remat's rerun of the MoE layer's all-to-alls (planner/experts.py)
      kv heads     K/V projections kept whole over tensor (grouped-query attention, see
                   docs/layouts.md) get gradient pieces from every head shard: their weight
                   gradients are summed over tensor (counted), and per layer their output
                   gradients too (named, not counted)"""
    shape = exp.mesh.shape
    compute = jnp.dtype(exp.model.cfg.dtype).itemsize
    params = list(leaves(exp))
    tied = not any(leaf.axes == ("embed", "vocab") for leaf in params)
    t_axes = split_over(exp.layout, shape, "heads")[1]
    out, conv_rows, context_rows = [], {}, {}
    for leaf in params:
        reduce_axes = [a for a in leaf.splits if a not in leaf.params]
        if tied and leaf.axes == ("vocab", "embed") and reduce_axes:
            n = group_size(shape, reduce_axes)
            out.append({"kind": "all-reduce", "mesh_axes": tuple(reduce_axes),
                        "bytes": 2 * (n - 1) / n * leaf.local * compute,
                        "why": f"the tied table {leaf.path} is reduced twice, its lookup and its output-"
                               f"projection gradients apart"})
        plain = [a for a in reduce_axes if a not in leaf.opt]
        # the bound's reduced share (collective_bounds): convs under a row split, every leaf
        # under a context split
        for rows, first, what, split in ((conv_rows, leaf.rows, "conv gradients", "the row split"),
                                         (context_rows, leaf.positions, "gradients", "the context split")):
            if not (first and plain):
                continue
            n, r = group_size(shape, plain), group_size(shape, first)
            row = rows.setdefault(tuple(plain), {
                "kind": "all-reduce", "mesh_axes": tuple(plain), "bytes": 0.0,
                "why": f"{what} all-reduced whole over {'+'.join(plain)} after their all-reduce over "
                       f"{split} ({'+'.join(first)}), where a reduce-scatter there would leave 1/{r} "
                       f"of them to reduce"})
            row["bytes"] += 2 * (n - 1) / n * leaf.local * compute * (1 - 1 / r)
        kv_whole = [a for a in t_axes if a not in leaf.params]
        if "kv_heads" in leaf.axes and kv_whole:
            n = group_size(shape, kv_whole)
            out.append({"kind": "all-reduce", "mesh_axes": tuple(kv_whole),
                        "bytes": 2 * (n - 1) / n * leaf.local * compute,
                        "why": f"{leaf.path} is kept whole over tensor (kv heads unsplit): its gradient "
                               f"is summed over the head shards; so are, per layer, the small "
                               f"[b, T, kv_heads, head_dim] gradients of its output (with all-gathers "
                               f"within each kv group): split kv_heads over tensor to remove both"})
    return (out + list(conv_rows.values()) + list(context_rows.values())
            + [e.to_json() for cost in SPLIT_COSTS.values() if (t := cost.traffic(exp)) for e in t.excess()])
