"""A layer's backward split in two without repeating work: B, the input gradient (which the
previous stage waits for), and W, the weight gradients (which nobody waits for), as
zero-bubble schedules need them (Qi et al. 2023, arXiv 2401.10241; docs/pipeline.md).

    b, w = split_pullback(jax.vjp(layer, w, x)[1], g)
    dx, saved = b(g)          # B: the cotangent chain to x
    dw = w(saved)             # W: later, from what B saved

A function is traced once to a jaxpr (jitted bodies and remat inlined); B keeps the
equations its outputs need, W the others that the rest need, reading what B computed
(`saved`: B's values and the inputs W reads) instead of computing it again. Two VJPs (one
for dx, one for dw) would trace the same split with the cotangent chain in both: 5
matmuls instead of 4 on a residual MLP block.

A chunk of layers under `lax.scan` transposes to one scan equation that yields both
halves, so `LayerSplit` runs a chunk one layer at a time: a forward scan keeping each
layer's residuals but its weights, a reverse scan of B that keeps W's values (and makes
the weight gradients no matmul needs: biases, norm scales), and a scan of W.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax.extend import core


class Split(NamedTuple):
    """The two halves of a function's outputs. `first(*args)` -> (its outputs, saved);
    `second(saved)` -> the rest. `saved` (a list of arrays, `saved_avals`) holds what the
    second half reads: values the first computed and inputs (`saved_inputs[j]`: the index
    among the flat inputs of saved value j, or None for a computed one); `eqns` how many
    equations each half runs."""
    first: Callable
    second: Callable
    saved_avals: list
    saved_inputs: list
    eqns: tuple[int, int]
    mask: list  # per output, whether the first half computes it (`first`, or moved there)


# Equations that call a jaxpr inline: a jitted function or a remat'd layer inside the
# backward would otherwise be one equation yielding both halves.
_CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "checkpoint": "jaxpr", "remat2": "jaxpr"}


def _inline(jaxpr, consts, *args):
    """Evaluates `jaxpr` binding each equation again, the bodies of _CALLS in place."""
    env = dict(zip(jaxpr.constvars, consts)) | dict(zip(jaxpr.invars, args))
    read = lambda v: v.val if isinstance(v, core.Literal) else env[v]  # noqa: E731
    for e in jaxpr.eqns:
        ins = [read(v) for v in e.invars]
        body = e.params.get(_CALLS.get(e.primitive.name, ""))
        if body is not None:
            inner, inner_consts = (body.jaxpr, body.consts) if hasattr(body, "consts") else (body, [])
            outs = _inline(inner, inner_consts, *ins)
        else:
            with e.ctx.manager:
                outs = e.primitive.bind(*ins, **e.primitive.get_bind_params(e.params))
            outs = outs if e.primitive.multiple_results else [outs]
        env.update(zip(e.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


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


def split(fn: Callable, *args, first: Sequence[bool], matmul_free_first: bool = False) -> Split:
    """fn(*args) -> a flat list or tuple of arrays; `first` marks the outputs the first half
    computes. Traced once at `args` (arrays or ShapeDtypeStructs, any pytrees).
    `matmul_free_first`: an output the second half would compute without a matmul moves to
    the first (a norm's scale gradient: a reduction over values the second half would
    otherwise have to be handed)."""
    flat, in_tree = jax.tree.flatten(args)
    traced = jax.make_jaxpr(lambda *leaves: list(fn(*jax.tree.unflatten(in_tree, leaves))))(*flat)
    closed = jax.make_jaxpr(lambda *leaves: _inline(traced.jaxpr, traced.consts, *leaves))(*flat)
    jaxpr, eqns = closed.jaxpr, closed.jaxpr.eqns
    if len(first) != len(jaxpr.outvars):
        raise ValueError(f"split: `first` marks {len(first)} outputs, the function has {len(jaxpr.outvars)}")
    first = list(first)
    if matmul_free_first:
        done = set(_needed(eqns, [v for v, f in zip(jaxpr.outvars, first) if f]))
        first = [f or not any(eqns[i].primitive.name == "dot_general" for i in _needed(eqns, [v]) if i not in done)
                 for v, f in zip(jaxpr.outvars, first)]
    outs_a = [v for v, f in zip(jaxpr.outvars, first) if f]
    outs_b = [v for v, f in zip(jaxpr.outvars, first) if not f]
    in_a = _needed(eqns, outs_a)
    in_b = [i for i in _needed(eqns, outs_b) if i not in set(in_a)]
    made_by_b = {o for i in in_b for o in eqns[i].outvars}
    read_by_b = [v for i in in_b for v in eqns[i].invars] + outs_b
    consts = set(jaxpr.constvars)
    saved = list(dict.fromkeys(v for v in read_by_b if isinstance(v, core.Var)
                               and v not in made_by_b and v not in consts))
    position = {v: j for j, v in enumerate(jaxpr.invars)}

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

    return Split(first_half, second_half, [v.aval for v in saved], [position.get(v) for v in saved],
                 (len(in_a), len(in_b)), first)


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


class LayerSplit:
    """One layer's backward, split, for a chunk of L layers: layer(w, k, x) -> y like x,
    differentiated in w (a pytree) and x, k riding along (a dropout key, or None); `ws`
    stacks the layers' weights on dim `axis` of every leaf, `ks` (or None) on dim 0.
    Traced once at one layer's shapes.

    The forward keeps each layer's residuals (what jax.vjp's pullback holds) but the
    weights, which every item shares; `backward` runs each layer's pullback from them in a
    reverse scan; B (`input_grads`) runs each layer's share of it for dx and keeps what W
    reads; W (`weight_grads`) runs the rest in a scan. Per layer because a scan's
    transpose is one equation that yields both halves."""

    def __init__(self, layer: Callable, ws, ks, x, axis: int = 0):
        self.layer, self.axis = layer, axis
        self.n = jax.tree.leaves(ws)[0].shape[axis]
        one = lambda a, axis: jax.ShapeDtypeStruct(a.shape[:axis] + a.shape[axis + 1:], a.dtype)  # noqa: E731
        w1, k1 = jax.tree.map(lambda a: one(a, axis), ws), jax.tree.map(lambda a: one(a, 0), ks)
        self.x1 = jax.ShapeDtypeStruct(x.shape, x.dtype)
        self.weights = jax.tree.structure(ws)
        box = []

        def residuals(w, k, x):
            pull = jax.vjp(lambda w, x: layer(w, k, x), w, x)[1]
            leaves, tree = jax.tree.flatten(pull)
            w_leaves = jax.tree.leaves(w)
            box.append((tree, [next((j for j, a in enumerate(w_leaves) if a is leaf), None) for leaf in leaves]))
            return leaves
        self.res_avals = jax.eval_shape(residuals, w1, k1, self.x1)
        self.pull_tree, self.shared = box[0]

    @functools.cached_property
    def halves(self) -> Split:
        """The pullback's outputs (d weights..., dx) cut: B computes dx and the weight
        gradients that need no matmul (norm scales), W the rest."""
        n_dw = self.weights.num_leaves
        return split(lambda res, g: jax.tree.leaves(jax.tree.unflatten(self.pull_tree, res)(g)),
                     self.res_avals, self.x1, first=[False] * n_dw + [True], matmul_free_first=True)

    @functools.cached_property
    def in_b(self) -> list[bool]:
        """Per weight leaf, whether B computes its gradient."""
        return self.halves.mask[:-1]

    @functools.cached_property
    def from_weights(self) -> list:
        """Per value W reads: the index of the weight it is (read from the weights again,
        not kept in W's stash), or None."""
        return [None if p is None or p >= len(self.res_avals) else self.shared[p] for p in self.halves.saved_inputs]

    def tree(self, *parts):
        """Flat lists of weight gradients with None where another half has it -> like ws."""
        return jax.tree.unflatten(self.weights, [next(d for d in ds if d is not None) for ds in zip(*parts)])

    def _at(self, ws, i):
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, self.axis, keepdims=False), ws)

    def _stacked(self, dws: list) -> list:
        """[L, ...] per leaf, as scans stack them -> the layer dim where ws has it."""
        return [None if d is None else jnp.moveaxis(d, 0, self.axis) for d in dws]

    def _leaves(self, ws, i, stashed):
        """Layer i's pullback leaves: the stashed ones, and its weights where they are."""
        w_leaves, stashed = jax.tree.leaves(self._at(ws, i)), iter(stashed)
        return [next(stashed) if j is None else w_leaves[j] for j in self.shared]

    def forward(self, ws, ks, x):
        """-> (y, res): res [L, ...] per residual leaf, the weights left out."""
        def one(x, i_k):
            i, k = i_k
            y, pull = jax.vjp(lambda w, x: self.layer(w, k, x), self._at(ws, i), x)
            return y, [a for a, j in zip(jax.tree.leaves(pull), self.shared) if j is None]
        return jax.lax.scan(one, x, (jnp.arange(self.n), ks))

    def backward(self, ws, res, g):
        """The fused backward from `forward`'s residuals: -> (dx, d ws like ws)."""
        def one(g, i_res):
            dw, dx = jax.tree.unflatten(self.pull_tree, self._leaves(ws, *i_res))(g)
            return dx, dw
        dx, dws = jax.lax.scan(one, g, (jnp.arange(self.n), res), reverse=True)
        return dx, jax.tree.unflatten(self.weights, self._stacked(jax.tree.leaves(dws)))

    def input_grads(self, ws, res, g):
        """B: -> (dx, d weights B computes (a flat list, None where W does), kept: [L, ...]
        per value W reads)."""
        def one(g, i_res):
            outs, saved = self.halves.first(self._leaves(ws, *i_res), g)
            return outs[-1], (outs[:-1], [a for a, j in zip(saved, self.from_weights) if j is None])
        dx, (dws, kept) = jax.lax.scan(one, g, (jnp.arange(self.n), res), reverse=True)
        dws = iter(dws)
        return dx, self._stacked([next(dws) if b else None for b in self.in_b]), kept

    def weight_grads(self, ws, kept):
        """W: -> d weights, a flat list with None where B computed them (`tree` joins them)."""
        def one(_, i_kept):
            i, kept = i_kept
            w_leaves, kept = jax.tree.leaves(self._at(ws, i)), iter(kept)
            return None, self.halves.second([next(kept) if j is None else w_leaves[j] for j in self.from_weights])
        _, dws = jax.lax.scan(one, None, (jnp.arange(self.n), kept))
        dws = iter(dws)
        return self._stacked([None if b else next(dws) for b in self.in_b])
