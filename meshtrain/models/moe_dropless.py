"""Dropless expert computation: every routed copy of every token goes through its expert.

Per device (under shard_map, from the layout's activation specs; or on the whole arrays
when there is no mesh), with n local tokens, k copies each and the X/ep experts it holds:

  1. sort the n k copies by expert id, so each expert's rows are contiguous;
  2. experts split over `ep` devices (the mesh axes the layout gives `experts`):
       tokens split over those axes too (the presets: `batch:...+expert`): one
       all-to-all over them sends each device's copies to the device of their expert.
       Shapes are static, so each destination gets a buffer of n k rows (all copies
       could choose experts of one device), of which its share is filled: dropless at
       ep times the bytes of the routed copies. A second all-to-all brings the outputs
       back. (The ragged all-to-all that sends only the filled rows has no CPU
       implementation in XLA; docs/models.md.)
       tokens not split over them: each device computes the copies routed to its own
       experts and the outputs are summed over the expert axes.
  3. each expert's rows go through its SwiGLU as a grouped matmul (`jax.lax.ragged_dot`:
     one [rows, D] x [X/ep, D, F] product with each row block against its group);
  4. the copies are put back in token order and summed with their routing weights; an
     expert mlp split over `tensor` gives partial sums, summed over tensor once, on [n, D].

Shapes: B batch, T length, D embed, X experts, k per token, F expert mlp, n = B T.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.custom_batching import sequential_vmap
from jax.sharding import PartitionSpec as P

from meshtrain.errors import UserError
from meshtrain.models.context_attention import mesh_axes as _axes
from meshtrain.models.stack import BTD

W_IN = ("experts", "embed", "mlp")
W_OUT = ("experts", "mlp", "embed")


# jax.lax.ragged_dot has no batching rule for an unbatched weight, and the step vmaps the
# loss over data-parallel replicas (grad_reduce.per_replica: grad_dtype, accumulation).
# So the grouped matmul and its gradient each loop over a vmapped dim (one replica per
# device: a loop of one), and its backward is JAX's own vjp of ragged_dot, run unbatched.
@sequential_vmap
def _ragged(x_md, w_gdf, sizes_g):
    return jax.lax.ragged_dot(x_md, w_gdf, sizes_g)


@sequential_vmap
def _ragged_vjp(x_md, w_gdf, sizes_g, dy_mf):
    return jax.vjp(lambda x, w: jax.lax.ragged_dot(x, w, sizes_g), x_md, w_gdf)[1](dy_mf)


@jax.custom_vjp
def grouped_dot(x_md: jax.Array, w_gdf: jax.Array, sizes_g: jax.Array) -> jax.Array:
    """Rows x [m, D] in groups of sizes [g] times their group's w [g, D, F] -> [m, F]
    (rows past the groups give zeros): `jax.lax.ragged_dot`, safe under vmap."""
    return _ragged(x_md, w_gdf, sizes_g)


grouped_dot.defvjp(lambda x, w, sizes: (_ragged(x, w, sizes), (x, w, sizes)),
                   lambda res, dy: (*_ragged_vjp(*res, dy), None))


def swiglu_grouped(xs_md: jax.Array, sizes_g: jax.Array, w_gate, w_up, w_down) -> jax.Array:
    """Rows xs [m, D] in groups of sizes [g] (rows past the groups give zeros) through
    their group's SwiGLU, weights [g, D, F], [g, D, F], [g, F, D] -> [m, D]."""
    dt = xs_md.dtype
    g = grouped_dot(xs_md, w_gate.astype(dt), sizes_g)
    u = grouped_dot(xs_md, w_up.astype(dt), sizes_g)
    return grouped_dot(jax.nn.silu(g) * u, w_down.astype(dt), sizes_g)


def _grouped(xs_md, ids_m, groups: int, ws) -> jax.Array:
    """Rows xs [m, D] with group ids [m] (ids >= groups: no group, output 0) -> [m, D]."""
    order = jnp.argsort(ids_m, stable=True)
    sizes = (ids_m[:, None] == jnp.arange(groups)[None, :]).sum(0).astype(jnp.int32)
    out_sorted = swiglu_grouped(xs_md[order], sizes, *ws)
    return jnp.zeros_like(out_sorted).at[order].set(out_sorted)


def _combine(out_nkd, w_nk):
    return jnp.einsum("nkd,nk->nd", out_nkd, w_nk.astype(out_nkd.dtype))


def local_experts(x_nd, e_nk, w_nk, ws) -> jax.Array:
    """All X experts on this device: x [n, D], expert ids [n, k], weights [n, k] -> [n, D]."""
    n, k = e_nk.shape
    out = _grouped(jnp.repeat(x_nd, k, axis=0), e_nk.reshape(-1), ws[0].shape[0], ws)
    return _combine(out.reshape(n, k, -1), w_nk)


def owned_experts(x_nd, e_nk, w_nk, ws, ep_axes) -> jax.Array:
    """This device's X/ep experts on tokens every expert device also holds: the copies
    routed elsewhere give 0, and the caller sums over `ep_axes`."""
    n, k = e_nk.shape
    held = ws[0].shape[0]
    local = e_nk.reshape(-1) - jax.lax.axis_index(ep_axes) * held
    ids = jnp.where((local >= 0) & (local < held), local, held)
    out = _grouped(jnp.repeat(x_nd, k, axis=0), ids, held, ws)
    return _combine(out.reshape(n, k, -1), w_nk)


def exchanged_experts(x_nd, e_nk, w_nk, ws, ep_axes, ep: int) -> jax.Array:
    """Tokens split over the expert axes: an all-to-all there and back (module docstring)."""
    n, k = e_nk.shape
    copies, held = n * k, ws[0].shape[0]
    e_flat = e_nk.reshape(-1)
    order = jnp.argsort(e_flat, stable=True)                          # copies by expert id
    e_sorted = e_flat[order]
    counts = (e_sorted[:, None] // held == jnp.arange(ep)[None, :]).sum(0)   # [ep] per device
    starts = jnp.cumsum(counts) - counts
    slot = jnp.arange(copies)[None, :]
    valid = slot < counts[:, None]                                    # [ep, copies]
    src = jnp.minimum(starts[:, None] + slot, copies - 1)             # row of the sorted copies
    xs = jnp.repeat(x_nd, k, axis=0)[order]
    send_x = jnp.where(valid[..., None], xs[src], 0)                  # [ep, copies, D]
    send_id = jnp.where(valid, e_sorted[src] % held, held)            # local expert id, or none
    recv_x = jax.lax.all_to_all(send_x, ep_axes, 0, 0, tiled=True)
    recv_id = jax.lax.all_to_all(send_id, ep_axes, 0, 0, tiled=True)
    out = _grouped(recv_x.reshape(ep * copies, -1), recv_id.reshape(-1), held, ws)
    back = jax.lax.all_to_all(out.reshape(ep, copies, -1), ep_axes, 0, 0, tiled=True)
    rows = jnp.where(valid, starts[:, None] + slot, copies)           # copies: dropped by scatter
    out_sorted = jnp.zeros((copies, back.shape[-1]), back.dtype).at[rows.reshape(-1)].add(
        back.reshape(ep * copies, -1), mode="drop")
    out_flat = jnp.zeros_like(out_sorted).at[order].set(out_sorted)
    return _combine(out_flat.reshape(n, k, -1), w_nk)


def experts(x_btd: jax.Array, e_btk: jax.Array, w_btk: jax.Array, ws, constrain) -> jax.Array:
    """x [B, T, D], expert ids and routing weights [B, T, k], ws = (w_gate [X, D, F],
    w_up [X, D, F], w_down [X, F, D]) -> sum_j w_j expert_{e_j}(x) [B, T, D]."""
    b, t, d = x_btd.shape
    k = e_btk.shape[-1]
    mesh = getattr(constrain, "mesh", None)
    if mesh is None:
        return local_experts(x_btd.reshape(b * t, d), e_btk.reshape(-1, k), w_btk.reshape(-1, k),
                             ws).reshape(b, t, d)
    # Tokens as attention and the MLP see them (sequence parallelism's stream split undone).
    x_spec = constrain.for_attention(BTD) if hasattr(constrain, "for_attention") else constrain.spec(BTD)
    w_in, w_out = constrain.spec(W_IN), constrain.spec(W_OUT)
    token_axes = _axes(x_spec[0]) + _axes(x_spec[1])
    ep_axes, mlp_axes = _axes(w_in[0]), _axes(w_in[2])
    if x_spec[2] is not None or w_in[1] is not None or w_out[2] is not None:
        raise UserError(f"the layout splits `embed` in the experts' compute (tokens {x_spec}, expert "
                        f"weights {w_in}); dropless dispatch keeps embed whole. Drop the `embed` rule "
                        f"from the activations table (fsdp splits it in params only), or use "
                        f"moe.dispatch=capacity.")
    if set(mlp_axes) & set(token_axes) or set(ep_axes) & set(mlp_axes):
        raise UserError(f"the layout splits the experts' `mlp` over mesh axes {mlp_axes} that also split "
                        f"the tokens ({token_axes}) or the experts ({ep_axes}); give `mlp` a mesh axis "
                        f"of its own (the presets use tensor).")
    ep = 1
    for a in ep_axes:
        ep *= mesh.shape[a]
    if ws[0].shape[0] % ep:
        raise UserError(f"{ws[0].shape[0]} experts do not divide over the {ep} devices of mesh axes "
                        f"{'+'.join(ep_axes)}; choose an expert axis size dividing model.num_experts.")
    route_spec = P(x_spec[0], x_spec[1], None)
    exchange = ep > 1 and set(ep_axes) <= set(token_axes)

    def body(x, e, w, *ws_local):
        bl, tl, _ = x.shape
        args = (x.reshape(bl * tl, d), e.reshape(-1, k), w.reshape(-1, k), ws_local)
        if ep == 1:
            y = local_experts(*args)
        elif exchange:
            y = exchanged_experts(*args, ep_axes, ep)
        else:
            y = jax.lax.psum(owned_experts(*args, ep_axes), ep_axes)
        if mlp_axes:
            y = jax.lax.psum(y, mlp_axes)
        return y.reshape(bl, tl, d)

    return jax.shard_map(body, mesh=mesh, in_specs=(x_spec, route_spec, route_spec, w_in, w_in, w_out),
                         out_specs=x_spec, check_vma=False)(x_btd, e_btk, w_btk, *ws)
