"""Dropless expert computation: every routed copy of every token goes through its expert.

Per device (parallel/experts.py moves the tokens to their experts' devices under
shard_map; with no mesh everything is local), with the X/ep experts it holds:

  1. sort the routed copies by expert id, so each expert's rows are contiguous;
  2. parallel/experts.py: the copies go to the devices of their experts (an all-to-all
     when the tokens are split over the expert axes) or stay (summed over them after);
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

from meshtrain.models import moe_ragged
from meshtrain.models.hook import Hook


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


def combine(out_nkd, w_nk):
    """Each token's k expert outputs [n, k, D] summed with its routing weights [n, k] -> [n, D]."""
    return jnp.einsum("nkd,nk->nd", out_nkd, w_nk.astype(out_nkd.dtype))


def local_experts(x_nd, e_nk, w_nk, ws, grouped) -> jax.Array:
    """All X experts on this device: x [n, D], expert ids [n, k], weights [n, k] -> [n, D]."""
    n, k = e_nk.shape
    out = grouped(jnp.repeat(x_nd, k, axis=0), e_nk.reshape(-1), ws[0].shape[0], ws)
    return combine(out.reshape(n, k, -1), w_nk)


def _grouped(xs_md, ids_m, groups: int, ws, mode: str = "windowed") -> jax.Array:
    """Rows xs [m, D] with group ids [m] (ids >= groups: no group, output 0) -> [m, D],
    by the windows or ragged_dot (`mode`, resolved)."""
    order = jnp.argsort(ids_m, stable=True)
    sizes = (ids_m[:, None] == jnp.arange(groups)[None, :]).sum(0).astype(jnp.int32)
    swiglu = moe_ragged.swiglu_ragged if mode == "ragged_dot" else swiglu_grouped
    return swiglu(xs_md, order, sizes, *ws)


def experts(x_btd: jax.Array, e_btk: jax.Array, w_btk: jax.Array, ws, constrain: Hook,
            grouped: str = "auto") -> jax.Array:
    """x [B, T, D], expert ids and routing weights [B, T, k], ws = (w_gate [X, D, F],
    w_up [X, D, F], w_down [X, F, D]) -> sum_j w_j expert_{e_j}(x) [B, T, D]; `grouped`
    is `moe.grouped_matmul`. On a mesh, parallel/experts.py moves the tokens to their
    experts' devices and back."""
    b, t, d = x_btd.shape
    k = e_btk.shape[-1]
    per_device = functools.partial(_grouped, mode=grouped_matmul(grouped))
    if not constrain.sharded:
        return local_experts(x_btd.reshape(b * t, d), e_btk.reshape(-1, k),
                             w_btk.reshape(-1, k), ws, per_device).reshape(b, t, d)
    return constrain.dispatch_experts(x_btd, e_btk, w_btk, ws, per_device)
