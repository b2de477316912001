"""A layer's backward split in two without repeating work: B, the input gradient (which the
previous stage waits for), and W, the weight gradients (which nobody waits for), as
zero-bubble schedules need them (Qi et al. 2023, arXiv 2401.10241; docs/pipeline.md).

    b, w = split_pullback(jax.vjp(layer, w, x)[1], g)
    dx, saved = b(g)          # B: the cotangent chain to x
    dw = w(saved)             # W: later, from what B saved

A function is traced once to a jaxpr; B keeps the equations its outputs need, W the others
that the rest need, reading what B computed (`saved`: B's values and the inputs W reads)
instead of computing it again. Two VJPs (one for dx, one for dw) would trace the same split
with the cotangent chain in both: 5 matmuls instead of 4 on a residual MLP block.

A chunk of layers under `lax.scan` transposes to one scan equation that yields both halves,
so `chunk_backward` splits per layer instead: a forward scan that keeps each layer's input,
a reverse scan of B that emits W's values, and a scan of W.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import jax
from jax.extend import core


class Split(NamedTuple):
    """The two halves of a function's outputs. `first(*args)` -> (its outputs, saved);
    `second(saved)` -> the rest. `saved` (a list of arrays, `saved_avals`) holds what the
    second half reads: values the first computed and inputs; `eqns` how many equations
    each half runs."""
    first: Callable
    second: Callable
    saved_avals: list
    eqns: tuple[int, int]


def _needed(eqns, outvars) -> list[int]:
    """Indices of the equations `outvars` depend on, in program order."""
    need = {v for v in outvars if isinstance(v, core.Var)}
    keep = []
    for i in reversed(range(len(eqns))):
        e = eqns[i]
        if e.effects or any(o in need for o in e.outvars):
            keep.append(i)
            need.update(v for v in e.invars if isinstance(v, core.Var))
    return keep[::-1]


def split(fn: Callable, *args, first: Sequence[bool]) -> Split:
    """fn(*args) -> a flat list or tuple of arrays; `first` marks the outputs the first half
    computes. Traced once at `args` (arrays or ShapeDtypeStructs, any pytrees)."""
    flat, in_tree = jax.tree.flatten(args)
    closed = jax.make_jaxpr(lambda *leaves: list(fn(*jax.tree.unflatten(in_tree, leaves))))(*flat)
    jaxpr, eqns = closed.jaxpr, closed.jaxpr.eqns
    if len(first) != len(jaxpr.outvars):
        raise ValueError(f"split: `first` marks {len(first)} outputs, the function has {len(jaxpr.outvars)}")
    outs_a = [v for v, f in zip(jaxpr.outvars, first) if f]
    outs_b = [v for v, f in zip(jaxpr.outvars, first) if not f]
    in_a = _needed(eqns, outs_a)
    in_b = [i for i in _needed(eqns, outs_b) if i not in set(in_a)]
    made_by_b = {o for i in in_b for o in eqns[i].outvars}
    read_by_b = [v for i in in_b for v in eqns[i].invars] + outs_b
    consts = set(jaxpr.constvars)
    saved = list(dict.fromkeys(v for v in read_by_b if isinstance(v, core.Var)
                               and v not in made_by_b and v not in consts))

    def half(name, invars, outvars, eqn_ids):
        debug = core.DebugInfo(f"split_backward {name}", jaxpr.debug_info.func_src_info, None, None)
        return core.Jaxpr(jaxpr.constvars, invars, outvars, [eqns[i] for i in eqn_ids], jaxpr.effects, debug)
    run_a = core.jaxpr_as_fun(core.ClosedJaxpr(half("first", jaxpr.invars, [*outs_a, *saved], in_a), closed.consts))
    run_b = core.jaxpr_as_fun(core.ClosedJaxpr(half("second", saved, outs_b, in_b), closed.consts))
    n_a = len(outs_a)

    def first_half(*call_args):
        outs = run_a(*jax.tree.leaves(call_args))
        return list(outs[:n_a]), list(outs[n_a:])

    def second_half(kept):
        return list(run_b(*kept))

    return Split(first_half, second_half, [v.aval for v in saved], (len(in_a), len(in_b)))


def split_pullback(pull, g) -> tuple[Callable, Callable]:
    """jax.vjp's pullback of f(w, x), split: -> (b, w) with b(g) -> (dx, saved) and
    w(saved) -> dw (pytrees like w and x). `g`: a cotangent of f's output, for tracing;
    `saved` holds the residuals and g itself where W reads them (a weight's gradient is
    its input times g)."""
    leaves, tree = jax.tree.flatten(pull)
    dw_tree, dx_tree = jax.tree.structure(jax.eval_shape(pull, g)).children()
    mask = [False] * dw_tree.num_leaves + [True] * dx_tree.num_leaves
    halves = split(lambda res, g: jax.tree.leaves(jax.tree.unflatten(tree, res)(g)), leaves, g, first=mask)

    def b(g):
        dx, saved = halves.first(leaves, g)
        return jax.tree.unflatten(dx_tree, dx), saved

    def w(saved):
        return jax.tree.unflatten(dw_tree, halves.second(saved))
    return b, w


def split_layer(layer: Callable, w, x) -> Split:
    """layer(w, x) -> y like x, its backward split: first(w, x, g) -> ([dx leaves], saved)
    runs the layer's forward again and B; second(saved) -> [dw leaves]. Traced once at the
    shapes of `w` and `x` (one layer's; arrays or ShapeDtypeStructs)."""
    def fwd_bwd(w, x, g):
        dw, dx = jax.vjp(layer, w, x)[1](g)
        return [*jax.tree.leaves(dw), *jax.tree.leaves(dx)]
    n_dw, n_dx = len(jax.tree.leaves(w)), len(jax.tree.leaves(x))
    return split(fwd_bwd, w, x, x, first=[False] * n_dw + [True] * n_dx)


def _one_layer(layer: Callable, ws, x) -> Split:
    """split_layer at one layer's shapes: ws [L, ...] without its layer axis, x as it is."""
    return split_layer(layer, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), ws),
                       jax.ShapeDtypeStruct(x.shape, x.dtype))


def chunk_backward(layer: Callable, ws, x, g):
    """B for a chunk of layers, y = layer(ws[L-1], ... layer(ws[0], x)), `ws` stacked on a
    leading [L] axis: -> (dx, kept), kept being W's stash ([L, ...] per saved value). The
    layers' forward runs again (as 1F1B's `inputs` stash does), keeping each one's input."""
    halves = _one_layer(layer, ws, x)
    _, inputs = jax.lax.scan(lambda h, w_l: (layer(w_l, h), h), x, ws)

    def b(g, w_x):
        (dx,), saved = halves.first(*w_x, g)
        return dx, saved
    dx, kept = jax.lax.scan(b, g, (ws, inputs), reverse=True)
    return dx, kept


def chunk_weight_grads(layer: Callable, ws, x, kept):
    """W for the chunk `chunk_backward` ran B of: -> d ws, like ws."""
    halves = _one_layer(layer, ws, x)
    _, dws = jax.lax.scan(lambda _, saved: (None, halves.second(saved)), None, kept)
    return jax.tree.unflatten(jax.tree.structure(ws), dws)
