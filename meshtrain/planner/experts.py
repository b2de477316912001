"""Expert parallelism's traffic and the experts' memory, by formula (docs/planner.md,
"Experts", sets them beside the compiled step's).

A layout that splits `experts` over mesh axes of total size e sends each token to the
devices of its experts and back by all-to-all. Per layer and microbatch, with b rows and
n = b T / (context split) tokens on a device, k experts per token, X experts, D embed,
C = ceil(k T capacity_factor / X) slots, c the compute dtype's bytes, each all-to-all
sending (e-1)/e of its buffer:

    dropless  float [e, n k, D] x c each way (static shapes: every destination gets a
              buffer for all n k copies), ids [e, n k] int32 with the dispatch
              forward 2 float + 1 ids;  backward 2 float (the transposes; ids have none)
    capacity  [X, b, C, D / embed split] x c each way;  forward 2;  backward 2
    remat full or save_dots: the forward's again ("recompute", known excess)

Tokens not split over the expert axes exchange nothing: no formula (dropless sums each
device's experts' outputs over those axes instead).

The experts' weights per device (w_gate, w_up [X, D, F], w_down [X, F, D] per layer):

    params     L x 3 X D F / (e x embed split x mlp split in the params table) x param bytes
    optimizer  the same at the opt_state table's split x the moments' bytes (Adam: 2)

The capacity drop estimate (`drop_share`): a near-uniform initial router sends each token's
k copies to k distinct experts picked uniformly, so an expert gets N ~ Binomial(T, k/X) of a
sequence's copies and drops those past C: the share dropped is X E[max(0, N - C)] / (k T).
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from meshtrain import tree_paths
from meshtrain.models import moe, remat
from meshtrain.parallel import experts as expert_parallel
from meshtrain.parallel.layouts.rules import mesh_axes_of
from meshtrain.planner import context
from meshtrain.planner.split_cost import Term, Traffic, local_batch, split_over
from meshtrain.step import optim

WEIGHTS = ("w_gate", "w_up", "w_down")


def has_experts(exp) -> bool:
    return getattr(exp.model.cfg, "num_experts", 0) > 1


def split(exp) -> tuple[int, tuple[str, ...]]:
    """(e, mesh axes of size > 1) the layout splits `experts` over in the experts' compute;
    (1, ()) for a model without experts."""
    return split_over(exp.layout, exp.mesh.shape, "experts", expert_parallel.W_IN) if has_experts(exp) else (1, ())


def _local(exp) -> dict:
    """rows b per microbatch on a device, tokens n, the batch's mesh axes, capacity slots."""
    cfg, layout, shape = exp.model.cfg, exp.layout, exp.mesh.shape
    b = local_batch(exp)["rows"]
    length = context.split(exp)[0]  # attention's split of the positions
    slots = moe.capacity(cfg.seq_len, cfg.num_experts, cfg.experts_per_token, cfg.moe.capacity_factor)
    return {"rows": b, "tokens": b * cfg.seq_len // length, "batch_axes": split_over(layout, shape, "batch")[1],
            "micro": exp.cfg.train.grad_accum_steps, "slots": slots, "bytes": jnp.dtype(cfg.dtype).itemsize}


def traffic(exp) -> Traffic | None:
    """The module docstring's all-to-alls, a Traffic of forward, recompute (remat's, known
    excess) and backward, with figures {"dispatch", "buffer_bytes" (one float all-to-all's
    buffer)}; None without an expert split; not counted where the tokens are not split
    over the expert axes."""
    if not has_experts(exp):
        return None
    e, axes = split(exp)
    if e == 1:
        return None
    cfg = exp.model.cfg
    mode, d, k = cfg.moe.dispatch, _local(exp), cfg.experts_per_token
    out = Traffic(axes, e, ("all-to-all",), figures={"dispatch": mode})
    layers = cfg.num_layers * d["micro"]
    wire = (e - 1) / e
    if mode == "dropless":
        stream = ("batch", "length", "embed")
        exchanged = set(axes) <= {a for n in ("batch", "length") for a in split_over(exp.layout, exp.mesh.shape, n, stream)[1]}
        buffer = e * d["tokens"] * k * cfg.embed_dim * d["bytes"]
        ids = e * d["tokens"] * k * 4
        per_pass, ops = 2 * buffer + ids, 3
    else:
        exchanged = set(axes) <= set(d["batch_axes"])
        embed = split_over(exp.layout, exp.mesh.shape, "embed", moe.AT_TOKENS)[0]
        buffer = cfg.num_experts * d["rows"] * d["slots"] * cfg.embed_dim / embed * d["bytes"]
        per_pass, ops = 2 * buffer, 2
    if not exchanged:
        out.not_counted.append(f"the tokens are not split over {'+'.join(axes)}: each device runs its "
                               f"experts on every token, no all-to-all (no formula for the sum instead)")
        out.counted = False
        return out
    again = remat.recomputes(cfg.remat)
    what = f"MoE ({mode}): tokens to their experts and back, forward and backward"
    out.figures["buffer_bytes"] = buffer
    out.terms = {"forward": Term("all-to-all", wire * layers * per_pass, layers * ops, True, what),
                 "recompute": Term("all-to-all", wire * layers * per_pass if again else 0.0,
                                   layers * ops if again else 0, False,
                                   f"model.remat={cfg.remat} reruns the MoE layer in the backward pass, and with "
                                   f"it the forward's dispatch and combine (planner/experts.py)"),
                 # the backward's transposes: the float buffers, not the ids
                 "backward": Term("all-to-all", wire * layers * 2 * buffer, layers * 2, True, what)}
    return out


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
        return {n: split_over(layout, shape, n, expert_parallel.W_IN, target)[0] for n in expert_parallel.W_IN}
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


def figures(exp, traffic: Traffic, compiled=None) -> dict:
    """{"weights": `weights`, with `compiled` its "compiled_params"}."""
    out = weights(exp)
    if compiled is not None:
        out["compiled_params"] = compiled_weights(exp, compiled)
    return {"weights": out}


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
