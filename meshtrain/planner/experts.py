"""Expert parallelism's traffic and the experts' memory, by formula, beside the compiled step's.

A layout that splits `experts` over mesh axes of total size e (the *_ep presets:
`experts:expert`, with the batch over the same axes) sends each token to the devices of
its experts and back by all-to-all over those axes (models/moe.py, models/moe_dropless.py).
Per layer and microbatch, with b rows and n = b T / (context split) tokens on a device,
k experts per token, X experts, D embed, C = ceil(k T capacity_factor / X) slots, c the
compute dtype's bytes, every all-to-all sends (e-1)/e of its buffer (the rest stays):

    dropless  a buffer of n k rows for each of the e destinations (shapes are static: every
              copy might choose one device's experts), so
                  float   [e, n k, D] x c         each way: dispatch and combine
                  ids     [e, n k] int32          with the dispatch (each row's local expert)
              forward   2 float + 1 ids;  backward   2 float (the transposes; ids have none)
    capacity  GShard's buffers, made where the tokens are and moved to their experts:
                  [X, b, C, D / embed split] x c  each way
              forward   2;  backward   2

A remat policy that reruns the MoE layer (full; save_dots too, whose policy saves no
batched or windowed matmul: measured, the same count as full) runs the forward's
all-to-alls again in the backward pass ("recompute": dropless 2 float + 1 ids, capacity 2).
The bound counts forward and backward; the recompute is remat's, named as known excess.
Layers x microbatches (train.grad_accum_steps) times each. Tokens not split over the
expert axes (a layout that gives `experts` axes the batch does not use) exchange nothing:
dropless sums each device's experts' outputs over those axes instead (an all-reduce of
[n, D]), counted as no formula here.

Measured on the tiny configs (tests/test_planner_experts.py): compiled/formula = 1.00 in
bytes and ops, for both dispatch modes.

The experts' weights per device (w_gate, w_up [X, D, F], w_down [X, F, D] per layer):

    params     L x 3 X D F / (e x embed split x mlp split in the params table) x param bytes
    optimizer  the same at the opt_state table's split x the moments' bytes (Adam: 2)

beside the rest of the parameters per device (attention, norms, router, tables).

The capacity drop estimate (`drop_share`): at initialisation the router is near uniform,
each token's k copies go to k distinct experts picked uniformly, so the copies one expert
gets from a sequence are Binomial(T, k/X) (each token includes it with probability k/X,
independently); the copies past C are dropped. Expected share dropped, exactly for that
model of routing: X E[max(0, N - C)] / (k T), N ~ Binomial(T, k/X).
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from meshtrain import tree_paths
from meshtrain.layouts.rules import mesh_axes_of
from meshtrain.models import moe
from meshtrain.parallel import experts as expert_parallel
from meshtrain.planner import hlo
from meshtrain.planner.split_cost import Bound, Excess
from meshtrain.step import optim

RECOMPUTES = ("full", "save_dots")  # remat policies that rerun the MoE layer in backward
WEIGHTS = ("w_gate", "w_up", "w_down")


def has_experts(exp) -> bool:
    return getattr(exp.model.cfg, "num_experts", 0) > 1


def split(exp) -> tuple[int, tuple[str, ...]]:
    """(e, mesh axes of size > 1) the layout splits `experts` over in the experts' compute;
    (1, ()) for a model without experts."""
    if not has_experts(exp):
        return 1, ()
    _, axes = exp.layout.split(expert_parallel.W_IN, "experts", exp.mesh.shape)
    axes = tuple(a for a in axes if exp.mesh.shape[a] > 1)
    return math.prod(exp.mesh.shape[a] for a in axes), axes


def _local(exp) -> dict:
    """rows b per microbatch on a device, tokens n, the batch's mesh axes, capacity slots."""
    cfg, layout, shape = exp.model.cfg, exp.layout, exp.mesh.shape
    micro = exp.cfg.train.grad_accum_steps
    rows, batch_axes = layout.shards("batch", shape)
    length, _ = layout.split(("batch", "length", "heads", "head_dim"), "length", shape)  # attention's split
    b = exp.cfg.train.batch_size // micro // rows
    k = cfg.experts_per_token
    slots = moe.capacity(cfg.seq_len, cfg.num_experts, k, cfg.moe.capacity_factor)
    return {"rows": b, "tokens": b * cfg.seq_len // length, "batch_axes": batch_axes, "micro": micro,
            "slots": slots, "bytes": jnp.dtype(cfg.dtype).itemsize}


def formula(exp) -> dict | None:
    """The module docstring's all-to-all bytes per device per step; None without an
    expert split. {"dispatch", "mesh_axes", "split", "terms": {forward, recompute,
    backward: bytes}, "ops": {same: ops}, "bytes", "count", "bound_bytes" (without
    recompute), "buffer_bytes" (one float all-to-all's buffer), "not_counted": [reasons]}."""
    if not has_experts(exp):
        return None
    e, axes = split(exp)
    if e == 1:
        return None
    cfg = exp.model.cfg
    mode, d, k = cfg.moe.dispatch, _local(exp), cfg.experts_per_token
    out = {"dispatch": mode, "mesh_axes": list(axes), "split": e, "not_counted": []}
    layers = cfg.num_layers * d["micro"]
    wire = (e - 1) / e
    if mode == "dropless":
        exchanged = set(axes) <= set(_axes(exp, ("batch", "length", "embed"), "batch")
                                     + _axes(exp, ("batch", "length", "embed"), "length"))
        buffer = e * d["tokens"] * k * cfg.embed_dim * d["bytes"]
        ids = e * d["tokens"] * k * 4
        per_pass, ops = 2 * buffer + ids, 3
        back, back_ops = 2 * buffer, 2
    else:
        exchanged = set(axes) <= set(d["batch_axes"])
        embed = exp.layout.split(moe.AT_TOKENS, "embed", exp.mesh.shape)[0]
        buffer = cfg.num_experts * d["rows"] * d["slots"] * cfg.embed_dim / embed * d["bytes"]
        per_pass, ops, back, back_ops = 2 * buffer, 2, 2 * buffer, 2
    if not exchanged:
        out["not_counted"].append(f"the tokens are not split over {'+'.join(axes)}: each device runs its "
                                  f"experts on every token, no all-to-all (no formula for the sum instead)")
        return {**out, "bytes": None, "count": 0}
    again = cfg.remat in RECOMPUTES
    out["buffer_bytes"] = buffer
    out["terms"] = {"forward": wire * layers * per_pass, "recompute": wire * layers * per_pass if again else 0.0,
                    "backward": wire * layers * back}
    out["ops"] = {"forward": layers * ops, "recompute": layers * ops if again else 0, "backward": layers * back_ops}
    out["bytes"] = sum(out["terms"].values())
    out["count"] = sum(out["ops"].values())
    out["bound_bytes"] = out["bytes"] - out["terms"]["recompute"]
    return out


def _axes(exp, axes, name) -> tuple[str, ...]:
    return exp.layout.split(axes, name, exp.mesh.shape)[1]


def weights(exp) -> dict | None:
    """The experts' weights per device by the module docstring's formula: {"params",
    "optimizer" (bytes per device), "rest_params", "rest_optimizer" (every other leaf, by
    its sharding), "split": {"experts", "embed", "mlp"} (params table)}; None without experts."""
    if not has_experts(exp):
        return None
    cfg, shape, layout = exp.model.cfg, exp.mesh.shape, exp.layout
    pbytes = jnp.dtype(cfg.param_dtype).itemsize
    moments = sum(jnp.dtype(t).itemsize for t in optim.moment_dtypes(exp.cfg.optim, cfg.param_dtype))
    size = cfg.num_layers * 3 * cfg.num_experts * cfg.embed_dim * cfg.mlp_dim

    def pieces(target):
        return {n: layout.split(expert_parallel.W_IN, n, shape, target)[0] for n in expert_parallel.W_IN}
    p, o = pieces("params"), pieces("opt_state")
    out = {"params": size / math.prod(p.values()) * pbytes, "optimizer": size / math.prod(o.values()) * moments,
           "split": p}
    rest = [(s, sh, gs) for path, (s, sh, gs) in _leaves(exp).items() if not _is_expert(path)]
    out["rest_params"] = sum(_shard(s, sh) for s, sh, _ in rest) * pbytes
    out["rest_optimizer"] = sum(_shard(s, gs) for s, _, gs in rest) * moments
    return out


def owned_axes(path: str, axes: tuple, sharding) -> tuple[str, ...]:
    """The mesh axes that split an expert weight's `experts` dim (its tokens travel to it:
    never gathered, unlike FSDP's weights); () for any other leaf."""
    if not _is_expert(path) or "experts" not in axes:
        return ()
    i = list(axes).index("experts")
    return mesh_axes_of(sharding.spec[i] if len(sharding.spec) > i else None)


def _is_expert(path: str) -> bool:
    return path.rsplit("/", 2)[-2:-1] == ["moe"] and path.rsplit("/", 1)[-1] in WEIGHTS


def _leaves(exp) -> dict:
    shapes = tree_paths.flat(exp.model.shapes)
    params, opt = tree_paths.flat(exp.shardings.params), tree_paths.flat(exp.grad_shardings)
    return {p: (shapes[p], params[p], opt[p]) for p in shapes}


def _shard(s, sharding) -> float:
    return float(math.prod(sharding.shard_shape(s.shape))) if s.shape else 1.0


def compiled_weights(exp, compiled) -> float:
    """Bytes per device of the experts' weights as the compiled step takes them (its input
    shardings' shard shapes)."""
    shapes = tree_paths.flat(exp.abstract_state().params)
    shardings = tree_paths.flat(compiled.input_shardings[0][0].params)
    return float(sum(_shard(s, shardings[p]) * s.dtype.itemsize for p, s in shapes.items() if _is_expert(p)))


def report(exp, rows: list[dict], compiled=None) -> dict | None:
    """`formula(exp)` with the compiled step's all-to-alls over the same mesh axes (`rows`:
    hlo.collective_table): "compiled_bytes", "compiled_count", "ratio" (compiled /
    formula); "weights" (`weights`), with `compiled` its "compiled_params"."""
    f = formula(exp)
    if f is None:
        return None
    hlo.with_compiled(f, rows, ("all-to-all",))
    f["weights"] = weights(exp)
    if compiled is not None:
        f["weights"]["compiled_params"] = compiled_weights(exp, compiled)
    return f


def bound_rows(exp) -> list[Bound]:
    """The experts' lower bound: forward and
    backward, no recompute."""
    f = formula(exp)
    if f is None or not f["bytes"]:
        return []
    o = f["ops"]
    return [Bound("all-to-all", tuple(f["mesh_axes"]), o["forward"] + o["backward"], f["bound_bytes"],
                  f"MoE ({f['dispatch']}): tokens to their experts and back, forward and backward")]


def known_excess(exp) -> list[Excess]:
    """The forward's all-to-alls again, where remat reruns the MoE layer."""
    f = formula(exp)
    if f is None or not f.get("terms", {}).get("recompute"):
        return []
    return [Excess("all-to-all", tuple(f["mesh_axes"]), f["terms"]["recompute"],
                   f"model.remat={exp.model.cfg.remat} reruns the MoE layer in the backward pass, and "
                   f"with it the forward's dispatch and combine (planner/experts.py)")]


def drop_share(seq_len: int, num_experts: int, k: int, factor: float) -> float:
    """The expected share of routed copies a sequence drops at capacity_factor `factor`
    under uniform routing (module docstring), exactly: X E[max(0, N - C)] / (k T)."""
    t, x = seq_len, num_experts
    c = moe.capacity(t, x, k, factor)
    p = k / x
    if p >= 1:
        return 0.0
    logs = [math.lgamma(t + 1) - math.lgamma(i + 1) - math.lgamma(t - i + 1) + i * math.log(p)
            + (t - i) * math.log1p(-p) for i in range(c + 1, t + 1)]
    over = sum(math.exp(v) * (i - c) for v, i in zip(logs, range(c + 1, t + 1)))
    return x * over / (k * t)


def factor_for(seq_len: int, num_experts: int, k: int, share: float) -> float:
    """The least capacity factor, to 0.05, whose expected drop share (`drop_share`) is
    below `share`."""
    f = 1.0
    while drop_share(seq_len, num_experts, k, f) >= share and f < num_experts / k:
        f = round(f + 0.05, 2)
    return f
