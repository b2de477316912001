"""Dropless's grouped matmuls as `jax.lax.ragged_dot` (`moe.grouped_matmul=ragged_dot`).

One call per weight: rows [m, D] in group order, weights [g, D, F], group sizes [g] ->
[m, F], each row against its own group's weight. What that costs is the backend's
lowering: XLA's CPU backend, and its GPU backend in the JAX meshtrain pins, compute every
row against every group, masked (g times the FLOPs; docs/models.md, "Dispatch"), where a
grouped-GEMM lowering computes each row once. The windows of moe_dropless.swiglu_grouped
are the default; this is the other side of the GPU measurement that will pick between them
(`moe_small_ragged` in benchmarks/gpu_runs.py).

JAX 0.10.2's batching rule for ragged_dot needs every operand batched along its first
dim, and gradient accumulation vmaps the loss over the data replicas with the weights
unbatched ("ragged_dot vmap over any dim but 0 - NYI"). `ragged_matmul` is therefore a
custom VJP whose forward and backward products are `custom_vmap`s that broadcast the
unbatched operands first (reverse-mode differentiation of a custom_vmap is not supported,
so the VJP is written out).

Shapes: m rows, D in, F out, g groups.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

# The products the backward pass keeps (as the windows keep their matmuls' outputs); the
# rows' gather and the SwiGLU's element-wise ops are recomputed.
SAVED = ("moe_ragged_gate", "moe_ragged_up", "moe_ragged_down")


def _all_batched(axis_size: int, in_batched, args) -> list:
    return [a if b else jnp.broadcast_to(a, (axis_size, *a.shape)) for a, b in zip(args, in_batched)]


@jax.custom_batching.custom_vmap
def _rows_by_group(x_md, w_gdf, sizes_g):
    """[m, D] x [g, D, F] with sizes [g] -> [m, F]: each row by its group's weight."""
    return jax.lax.ragged_dot(x_md, w_gdf, sizes_g)


@_rows_by_group.def_vmap
def _(axis_size, in_batched, x, w, sizes):
    return jax.vmap(jax.lax.ragged_dot)(*_all_batched(axis_size, in_batched, (x, w, sizes))), True


def _weight_grad(x_md, dy_mf, sizes_g):
    """[m, D], [m, F], sizes [g] -> [g, D, F], group e's rows' x^T dy: the transpose of
    _rows_by_group in its weights."""
    g, f = sizes_g.shape[0], dy_mf.shape[1]
    weights = jax.ShapeDtypeStruct((g, x_md.shape[1], f), dy_mf.dtype)
    (dw,) = jax.linear_transpose(lambda w: jax.lax.ragged_dot(x_md, w, sizes_g), weights)(dy_mf)
    return dw


_per_group = jax.custom_batching.custom_vmap(_weight_grad)


@_per_group.def_vmap
def _(axis_size, in_batched, x, dy, sizes):
    return jax.vmap(_weight_grad)(*_all_batched(axis_size, in_batched, (x, dy, sizes))), True


@jax.custom_vjp
def ragged_matmul(x_md: jax.Array, w_gdf: jax.Array, sizes_g: jax.Array) -> jax.Array:
    """`jax.lax.ragged_dot(x [m, D], w [g, D, F], sizes [g])` -> [m, F], under vmap
    with any operands batched. Rows past sum(sizes) are left to the backend (the caller
    masks them)."""
    return _rows_by_group(x_md, w_gdf, sizes_g)


def _fwd(x, w, sizes):
    return _rows_by_group(x, w, sizes), (x, w, sizes)


def _bwd(res, dy_mf):
    x, w, sizes = res
    dx = _rows_by_group(dy_mf, jnp.swapaxes(w, 1, 2), sizes)       # [m, F] x [g, F, D]
    return dx.astype(x.dtype), _per_group(x, dy_mf, sizes).astype(w.dtype), None


ragged_matmul.defvjp(_fwd, _bwd)


def swiglu_ragged(xs_md: jax.Array, order_m: jax.Array, sizes_g: jax.Array, w_gate, w_up, w_down) -> jax.Array:
    """moe_dropless.swiglu_grouped's contract with ragged_dot's products: rows xs [m, D]
    taken in `order` [m] fall in groups of sizes [g] (rows past the groups give zeros);
    each goes through its group's SwiGLU, weights [g, D, F], [g, D, F], [g, F, D], and its
    output lands in its own row -> [m, D]."""
    m, d = xs_md.shape
    dt = xs_md.dtype
    w_gate, w_up, w_down = (jnp.asarray(a, dt) for a in (w_gate, w_up, w_down))
    # ragged_dot leaves the rows past the groups to the backend: zeros in, zeros out.
    filled = (jnp.arange(m) < sizes_g.sum())[:, None]              # [m, 1]

    @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.save_only_these_names(*SAVED))
    def mlp(xs):  # [m, D] in token order -> [m, D] in group order
        x = jnp.where(filled, xs[order_m], 0)
        gate = checkpoint_name(ragged_matmul(x, w_gate, sizes_g), SAVED[0])   # [m, F]
        up = checkpoint_name(ragged_matmul(x, w_up, sizes_g), SAVED[1])
        y = checkpoint_name(ragged_matmul(jax.nn.silu(gate) * up, w_down, sizes_g), SAVED[2])
        return jnp.where(filled, y, 0)

    return jnp.zeros((m, d), dt).at[order_m].set(mlp(xs_md))
