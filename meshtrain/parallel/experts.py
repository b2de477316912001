"""Expert parallelism's dispatch, written per device with shard_map: models/moe_dropless.py
computes the experts, this moves their tokens.

Each device holds X/ep of the X experts, ep the devices on the mesh axes the layout
gives `experts`:

  tokens split over those axes too (the presets: `batch:...+expert`): one all-to-all over
      them sends each device's routed copies to the device of their expert, sorted by
      expert id. Shapes are static, so each destination gets a buffer of n k rows (all
      copies could choose experts of one device), of which its share is filled: dropless
      at ep times the bytes of the routed copies. A second all-to-all brings the outputs
      back. (The ragged all-to-all that sends only the filled rows has no CPU
      implementation in XLA; docs/models.md.)
  tokens not split over them: each device computes the copies routed to its own experts
      and the outputs are summed over the expert axes.

An expert mlp split over `tensor` gives partial sums, summed over tensor once, on [n, D].
The per-device compute is the caller's `grouped(xs [m, D], ids [m], groups, ws) -> [m, D]`:
each row through the SwiGLU of its group (an id >= groups: no group, output 0).

Shapes: B batch, T length, D embed, X experts, k per token, F expert mlp, n = B T.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from meshtrain.errors import UserError
from meshtrain.models.moe_dropless import combine, local_experts
from meshtrain.parallel.layouts.rules import Layout, mesh_axes_of
from meshtrain.parallel.sequence import BTD, for_attention

Grouped = Callable[..., jax.Array]
W_IN = ("experts", "embed", "mlp")   # the experts' weights' logical axes
W_OUT = ("experts", "mlp", "embed")


def owned_experts(x_nd, e_nk, w_nk, ws, grouped: Grouped, ep_axes) -> jax.Array:
    """This device's X/ep experts on tokens every expert device also holds: the copies
    routed elsewhere give 0, and the caller sums over `ep_axes`."""
    n, k = e_nk.shape
    held = ws[0].shape[0]
    local = e_nk.reshape(-1) - jax.lax.axis_index(ep_axes) * held
    ids = jnp.where((local >= 0) & (local < held), local, held)
    out = grouped(jnp.repeat(x_nd, k, axis=0), ids, held, ws)
    return combine(out.reshape(n, k, -1), w_nk)


def exchanged_experts(x_nd, e_nk, w_nk, ws, grouped: Grouped, ep_axes, ep: int) -> jax.Array:
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
    out = grouped(recv_x.reshape(ep * copies, -1), recv_id.reshape(-1), held, ws)
    back = jax.lax.all_to_all(out.reshape(ep, copies, -1), ep_axes, 0, 0, tiled=True)
    rows = jnp.where(valid, starts[:, None] + slot, copies)           # copies: dropped by scatter
    out_sorted = jnp.zeros((copies, back.shape[-1]), back.dtype).at[rows.reshape(-1)].add(
        back.reshape(ep * copies, -1), mode="drop")
    out_flat = jnp.zeros_like(out_sorted).at[order].set(out_sorted)
    return combine(out_flat.reshape(n, k, -1), w_nk)


def dispatch(x_btd: jax.Array, e_btk: jax.Array, w_btk: jax.Array, ws, layout: Layout, mesh,
             grouped: Grouped) -> jax.Array:
    """x [B, T, D], expert ids and routing weights [B, T, k], ws = (w_gate [X, D, F],
    w_up [X, D, F], w_down [X, F, D]) on the mesh -> sum_j w_j expert_{e_j}(x)
    [B, T, D]."""
    d = x_btd.shape[2]
    k = e_btk.shape[-1]
    # Tokens as attention and the MLP see them (sequence parallelism's stream split undone).
    x_spec = for_attention(layout, BTD)
    w_in, w_out = layout.spec(W_IN, "activations"), layout.spec(W_OUT, "activations")
    token_axes = mesh_axes_of(x_spec[0]) + mesh_axes_of(x_spec[1])
    ep_axes, mlp_axes = mesh_axes_of(w_in[0]), mesh_axes_of(w_in[2])
    if x_spec[2] is not None or w_in[1] is not None or w_out[2] is not None:
        raise UserError(f"the layout splits `embed` in the experts' compute (tokens {x_spec}, expert "
                        f"weights {w_in}); dropless dispatch keeps embed whole. Drop the `embed` rule "
                        f"from the activations table (fsdp splits it in params only), or use "
                        f"moe.dispatch=capacity.")
    if set(mlp_axes) & set(token_axes) or set(ep_axes) & set(mlp_axes):
        raise UserError(f"the layout splits the experts' `mlp` over mesh axes {mlp_axes} that also split "
                        f"the tokens ({token_axes}) or the experts ({ep_axes}); give `mlp` a mesh axis "
                        f"of its own (the presets use tensor).")
    ep = math.prod(mesh.shape[a] for a in ep_axes)
    if ws[0].shape[0] % ep:
        raise UserError(f"{ws[0].shape[0]} experts do not divide over the {ep} devices of mesh axes "
                        f"{'+'.join(ep_axes)}; choose an expert axis size dividing model.num_experts.")
    route_spec = P(x_spec[0], x_spec[1], None)
    exchange = ep > 1 and set(ep_axes) <= set(token_axes)

    def body(x, e, w, *ws_local):
        bl, tl, _ = x.shape
        args = (x.reshape(bl * tl, d), e.reshape(-1, k), w.reshape(-1, k), ws_local)
        if ep == 1:
            y = local_experts(*args, grouped)
        elif exchange:
            y = exchanged_experts(*args, grouped, ep_axes, ep)
        else:
            y = jax.lax.psum(owned_experts(*args, grouped, ep_axes), ep_axes)
        if mlp_axes:
            y = jax.lax.psum(y, mlp_axes)
        return y.reshape(bl, tl, d)

    return jax.shard_map(body, mesh=mesh, in_specs=(x_spec, route_spec, route_spec, w_in, w_in, w_out),
                         out_specs=x_spec, check_vma=False)(x_btd, e_btk, w_btk, *ws)
