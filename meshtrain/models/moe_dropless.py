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
  3. each expert's rows go through its SwiGLU as a grouped matmul, computed as
     `moe.grouped_matmul` says (`grouped_matmul`): `swiglu_grouped`'s windows of one
     expert's rows, batched against their experts' weights, about 1.25 times the rows'
     FLOPs; or `jax.lax.ragged_dot` (models/moe_ragged.py), whatever its lowering costs;
  4. the copies are put back in token order and summed with their routing weights; an
     expert mlp split over `tensor` gives partial sums, summed over tensor once, on [n, D].

Shapes: B batch, T length, D embed, X experts, k per token, F expert mlp, n = B T.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from meshtrain.errors import UserError
from meshtrain.models import moe_ragged
from meshtrain.models.context_attention import mesh_axes as _axes
from meshtrain.models.stack import BTD

W_IN = ("experts", "embed", "mlp")
W_OUT = ("experts", "mlp", "embed")


# A window is rows / (WINDOWS_PER_GROUP g) rows of one group, so the windows compute at
# most 1 + 1 / WINDOWS_PER_GROUP times the rows (each group's last window is partly empty:
# at most g windows' worth).
WINDOWS_PER_GROUP = 4

# What `moe.grouped_matmul=auto` computes on each backend. CPU: the windows, measured
# (Mixtral tiny on data:8: 1.26x the model's matmul FLOPs where ragged_dot compiled to
# 2.99x; docs/models.md). GPU: the windows, measured (one H200, a GPT-2-small-width MoE:
# 133.8 ms a step against ragged_dot's 233.5; docs/benchmarks.md). TPU: not measured.
AUTO = {"cpu": "windowed", "gpu": "windowed", "tpu": "windowed"}


def grouped_matmul(mode: str, platform: str | None = None) -> str:
    """`moe.grouped_matmul` resolved to "windowed" or "ragged_dot": auto by AUTO for
    `platform` ("cpu", "gpu", "tpu"; None: JAX's default backend), the others as given."""
    if mode != "auto":
        return mode
    return AUTO.get(platform or jax.default_backend(), "windowed")


def windows(sizes_g: jax.Array, rows: int) -> tuple[int, jax.Array, jax.Array, jax.Array]:
    """Windows over rows sorted by group (sizes [g], summing to at most `rows`), each within
    one group: -> (w, group [I], first row [I], rows it owns [I]) with w rows a window and
    I >= rows // w + g windows, a multiple of g, enough for any sizes (a group of s rows
    takes ceil(s / w)); the windows past those own no row."""
    g = sizes_g.shape[0]
    w = max(1, -(-rows // (WINDOWS_PER_GROUP * g)))
    count = -(-(rows // w + g) // g) * g
    per = -(-sizes_g // w)                                        # [g] windows of each group
    end = jnp.cumsum(per)
    i = jnp.arange(count)
    group = jnp.minimum((end[None, :] <= i[:, None]).sum(1), g - 1)   # [I]
    j = i - (end - per)[group]                                    # the window's place in its group
    first = (jnp.cumsum(sizes_g) - sizes_g)[group] + j * w
    owned = jnp.clip(sizes_g[group] - j * w, 0, w)
    return w, group, first, owned


def swiglu_grouped(xs_md: jax.Array, order_m: jax.Array, sizes_g: jax.Array, w_gate, w_up, w_down) -> jax.Array:
    """Rows xs [m, D] taken in `order` [m] fall in groups of sizes [g] (rows past the
    groups give zeros); each goes through its group's SwiGLU, weights [g, D, F], [g, D, F],
    [g, F, D], and its output lands in its own row -> [m, D].

    A grouped matmul from plain ones: the rows in group order are cut into windows of w rows
    of one group (`windows`), and g windows at a time run as one batched matmul against
    their groups' weights, so the compute is about (1 + 1 / WINDOWS_PER_GROUP) times the
    rows' (`jax.lax.ragged_dot`, which XLA's CPU backend and, without a grouped-GEMM
    kernel, its GPU backend lower as every row against every group, costs g times;
    docs/models.md has the measurements). The backward pass keeps the matmuls' outputs and
    gathers the rows and weights again, so no window keeps a copy of its group's weights."""
    m, d = xs_md.shape
    g = sizes_g.shape[0]
    dt = xs_md.dtype
    w_gate, w_up, w_down = (jnp.asarray(a, dt) for a in (w_gate, w_up, w_down))
    w, group, first, owned = windows(sizes_g, m)
    rows_iw = order_m[jnp.minimum(first[:, None] + jnp.arange(w)[None, :], m - 1)]   # [I, w] rows of xs
    mine = jnp.arange(w)[None, :] < owned[:, None]                 # [I, w] rows the window owns

    @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.dots_saveable)
    def window(args):  # one window's rows [w], which it owns [w], its group [] -> [w, D]
        rows, own, e = args
        x = jnp.where(own[:, None], xs_md[rows], 0)
        h = jax.nn.silu(x @ w_gate[e]) * (x @ w_up[e])
        return h @ w_down[e]

    out_iwd = jax.lax.map(window, (rows_iw, mine, group), batch_size=g)
    return jnp.zeros((m, d), dt).at[jnp.where(mine, rows_iw, m)].add(out_iwd, mode="drop")


def _grouped(xs_md, ids_m, groups: int, ws, mode: str = "windowed") -> jax.Array:
    """Rows xs [m, D] with group ids [m] (ids >= groups: no group, output 0) -> [m, D],
    by the windows or ragged_dot (`mode`, resolved)."""
    order = jnp.argsort(ids_m, stable=True)
    sizes = (ids_m[:, None] == jnp.arange(groups)[None, :]).sum(0).astype(jnp.int32)
    swiglu = moe_ragged.swiglu_ragged if mode == "ragged_dot" else swiglu_grouped
    return swiglu(xs_md, order, sizes, *ws)


def _combine(out_nkd, w_nk):
    return jnp.einsum("nkd,nk->nd", out_nkd, w_nk.astype(out_nkd.dtype))


def local_experts(x_nd, e_nk, w_nk, ws, mode: str = "windowed") -> jax.Array:
    """All X experts on this device: x [n, D], expert ids [n, k], weights [n, k] -> [n, D]."""
    n, k = e_nk.shape
    out = _grouped(jnp.repeat(x_nd, k, axis=0), e_nk.reshape(-1), ws[0].shape[0], ws, mode)
    return _combine(out.reshape(n, k, -1), w_nk)


def owned_experts(x_nd, e_nk, w_nk, ws, ep_axes, mode: str = "windowed") -> jax.Array:
    """This device's X/ep experts on tokens every expert device also holds: the copies
    routed elsewhere give 0, and the caller sums over `ep_axes`."""
    n, k = e_nk.shape
    held = ws[0].shape[0]
    local = e_nk.reshape(-1) - jax.lax.axis_index(ep_axes) * held
    ids = jnp.where((local >= 0) & (local < held), local, held)
    out = _grouped(jnp.repeat(x_nd, k, axis=0), ids, held, ws, mode)
    return _combine(out.reshape(n, k, -1), w_nk)


def exchanged_experts(x_nd, e_nk, w_nk, ws, ep_axes, ep: int, mode: str = "windowed") -> jax.Array:
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
    out = _grouped(recv_x.reshape(ep * copies, -1), recv_id.reshape(-1), held, ws, mode)
    back = jax.lax.all_to_all(out.reshape(ep, copies, -1), ep_axes, 0, 0, tiled=True)
    rows = jnp.where(valid, starts[:, None] + slot, copies)           # copies: dropped by scatter
    out_sorted = jnp.zeros((copies, back.shape[-1]), back.dtype).at[rows.reshape(-1)].add(
        back.reshape(ep * copies, -1), mode="drop")
    out_flat = jnp.zeros_like(out_sorted).at[order].set(out_sorted)
    return _combine(out_flat.reshape(n, k, -1), w_nk)


def experts(x_btd: jax.Array, e_btk: jax.Array, w_btk: jax.Array, ws, constrain,
            grouped: str = "auto") -> jax.Array:
    """x [B, T, D], expert ids and routing weights [B, T, k], ws = (w_gate [X, D, F],
    w_up [X, D, F], w_down [X, F, D]) -> sum_j w_j expert_{e_j}(x) [B, T, D]; `grouped`
    is `moe.grouped_matmul`."""
    b, t, d = x_btd.shape
    k = e_btk.shape[-1]
    mode = grouped_matmul(grouped)
    mesh = getattr(constrain, "mesh", None)
    if mesh is None:
        return local_experts(x_btd.reshape(b * t, d), e_btk.reshape(-1, k), w_btk.reshape(-1, k),
                             ws, mode).reshape(b, t, d)
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
            y = local_experts(*args, mode)
        elif exchange:
            y = exchanged_experts(*args, ep_axes, ep, mode)
        else:
            y = jax.lax.psum(owned_experts(*args, ep_axes, mode), ep_axes)
        if mlp_axes:
            y = jax.lax.psum(y, mlp_axes)
        return y.reshape(bl, tl, d)

    return jax.shard_map(body, mesh=mesh, in_specs=(x_spec, route_spec, route_spec, w_in, w_in, w_out),
                         out_specs=x_spec, check_vma=False)(x_btd, e_btk, w_btk, *ws)
