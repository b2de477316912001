"""A layer's backward split in two without repeating work: B, the input gradient (which the
previous stage waits for), and W, the weight gradients (which nobody waits for), as
zero-bubble schedules need them (Qi et al. 2023, arXiv 2401.10241; docs/pipeline.md).

    pull = jax.vjp(chunk, w, x)[1]                 # residuals in pull's leaves
    b, w_grads = split(lambda leaves, g: unflatten(leaves)(g), leaves, g, first=dx_mask)
    dx, saved = b(leaves, g)                       # B: the cotangent chain to x
    dw = w_grads(leaves, saved)                    # W: later, from what B saved

The pullback is traced once to a jaxpr; B keeps the equations its outputs need, W the
others that the weight gradients need, reading what B computed (`saved`) instead of
computing it again. Two VJPs (one for dx, one for dw) would trace the same split with
the cotangent chain in both: about a third more backward FLOPs on a residual MLP block.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import jax
from jax.extend import core


class Split(NamedTuple):
    """The two halves of a function's outputs. `first(*args)` -> (its outputs, saved);
    `second(*args, saved)` -> the rest. `saved` are the values the second half reads from
    the first (a list of arrays); `reads` marks the flat inputs the second half reads;
    `eqns` how many equations each half runs."""
    first: Callable
    second: Callable
    saved_avals: list
    reads: list[bool]
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
    made_by_a = {o for i in in_a for o in eqns[i].outvars}
    in_b = [i for i in _needed(eqns, outs_b) if i not in set(in_a)]
    read_by_b = [v for i in in_b for v in eqns[i].invars] + outs_b
    saved = list(dict.fromkeys(v for v in read_by_b if isinstance(v, core.Var) and v in made_by_a))
    def half(name, invars, outvars, eqn_ids):
        debug = core.DebugInfo(f"split_backward {name}", jaxpr.debug_info.func_src_info, None, None)
        return core.Jaxpr(jaxpr.constvars, invars, outvars, [eqns[i] for i in eqn_ids], jaxpr.effects, debug)
    half_a = half("first", jaxpr.invars, [*outs_a, *saved], in_a)
    half_b = half("second", [*jaxpr.invars, *saved], outs_b, in_b)
    run_a = core.jaxpr_as_fun(core.ClosedJaxpr(half_a, closed.consts))
    run_b = core.jaxpr_as_fun(core.ClosedJaxpr(half_b, closed.consts))
    n_a = len(outs_a)

    def first_half(*call_args):
        outs = run_a(*jax.tree.leaves(call_args))
        return list(outs[:n_a]), list(outs[n_a:])

    def second_half(*call_args_and_saved):
        *call_args, kept = call_args_and_saved
        return list(run_b(*jax.tree.leaves(call_args), *kept))

    read_vars = {v for v in read_by_b if isinstance(v, core.Var)}
    reads = [v in read_vars for v in jaxpr.invars]
    return Split(first_half, second_half, [v.aval for v in saved], reads, (len(in_a), len(in_b)))


def split_pullback(pull, g) -> tuple[Callable, Callable]:
    """jax.vjp's pullback of f(w, x), split: -> (b, w) with b(g) -> (dx, saved) and
    w(saved) -> dw (pytrees like w and x). `g`: a cotangent of f's output, for tracing;
    `saved` holds g itself where W reads it (a weight's gradient is its input times g)."""
    leaves, tree = jax.tree.flatten(pull)
    out_tree = jax.tree.structure(jax.eval_shape(pull, g))
    dw_tree, dx_tree = out_tree.children()
    n_dw = dw_tree.num_leaves
    mask = [False] * n_dw + [True] * dx_tree.num_leaves
    halves = split(lambda res, g: jax.tree.leaves(jax.tree.unflatten(tree, res)(g)), leaves, g, first=mask)

    reads_g = any(halves.reads[len(leaves):])

    def b(g):
        dx, saved = halves.first(leaves, g)
        return jax.tree.unflatten(dx_tree, dx), (g if reads_g else None, saved)

    def w(saved):
        g_kept, kept = saved
        g_in = g_kept if reads_g else jax.tree.map(lambda a: jax.numpy.zeros(a.shape, a.dtype), g)
        return jax.tree.unflatten(dw_tree, halves.second(leaves, g_in, kept))
    return b, w
