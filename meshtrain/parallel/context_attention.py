"""Causal attention over a sequence whose positions are split over devices (context
parallelism, `model.context_attention`), written per device with shard_map.

Each of the n devices on attention's `length` axes holds 2c = T/n rows of q, k and v in
the zigzag order of parallel/sequence.py: chunk i (positions i c .. i c + c-1) and chunk
2n-1-i. Shapes per device: q, k, v [B, 2c, H, E] (B, H: this device's share of the batch
and heads), positions [2c] int32.

  allgather  (Llama 3's recipe, Dubey et al. 2024 §3.3.2) k and v are all-gathered over
             the context axes, [B, T, H, E], and each query row attends to every key
             whose position is <= its own: scores [B, H, 2c, T] per device. Backward
             reduce-scatters dk and dv.
  ring       (Liu et al. 2023, Ring Attention) k and v travel once around the ring, a
             ppermute per step, while each device folds one block at a time into an
             online softmax (running max m, sum l, unnormalised output o, as flash
             attention): scores are never bigger than [B, H, 2c, c].

The ring's load balance. At step 0 a device attends its own 2c keys, with the causal mask
by position. At step j > 0 it holds the keys of device s = (i - j) mod n:
  s < i:  both its chunks are later than chunk s and earlier than chunk 2n-1-s, so all 2c
          queries see the first c keys and none sees the last c;
  s > i:  chunk i sees neither of s's chunks, chunk 2n-1-i sees both:
          the last c queries see all 2c keys.
Either way one [2c x c] or [c x 2c] block, unmasked, equal work on every device and every
step; the masked half is never computed. Per device: 4 c^2 + (n-1) 2 c^2 score entries,
against (2nc)^2 / 2n = 2 n c^2 for a perfect split of the causal triangle, (n+1)/n of it.

A packed window's documents (models/documents.py) add a mask inside the blocks: each
device's segment ids [B, 2c] travel with its k and v (gathered, or round the ring), and a
query sees a key of its own segment only. Which blocks are computed does not change.

Arithmetic: scores in float32, scaled after the product, probabilities cast to v's dtype
for the second matmul, as models/attention.causal_attention. Masked scores are not used
at all (exp is where'd to 0), so a row's running max is always a real score: every row
sees its own position at step 0.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from meshtrain.errors import UserError
from meshtrain.models.attention import BTHE, BTKE, check_context_kind
from meshtrain.parallel import sequence
from meshtrain.parallel.layouts.rules import Layout, mesh_axes_of

_NEG = float(-0.7 * np.finfo(np.float32).max)  # a masked score, as attention._MASKED


def _scores(q_bqhe, k_bkhe):
    s = jnp.einsum("bqhe,bkhe->bhqk", q_bqhe, k_bkhe, preferred_element_type=jnp.float32)
    return s * jnp.float32(1.0 / np.sqrt(q_bqhe.shape[-1]))


def _block(q_bqhe, k_bkhe, v_bkhe, mask_qk=None):
    """One block of keys: -> (o [B, q, H, E] float32 unnormalised, m [B, H, q], l [B, H, q])."""
    s = _scores(q_bqhe, k_bkhe)
    if mask_qk is not None:
        s = jnp.where(mask_qk, s, jnp.float32(_NEG))
    m = jnp.max(s, axis=-1)
    p = jnp.exp(s - m[..., None])
    if mask_qk is not None:
        p = jnp.where(mask_qk, p, 0.0)
    o = jnp.einsum("bhqk,bkhe->bqhe", p.astype(v_bkhe.dtype), v_bkhe, preferred_element_type=jnp.float32)
    return o, m, jnp.sum(p, axis=-1)


def _merge(acc, new):
    """Online softmax: two partial results over disjoint keys -> their union's."""
    (o1, m1, l1), (o2, m2, l2) = acc, new
    m = jnp.maximum(m1, m2)
    a1, a2 = jnp.exp(m1 - m), jnp.exp(m2 - m)
    scale = lambda a: jnp.swapaxes(a, 1, 2)[..., None]  # [B, H, q] -> [B, q, H, 1]
    return o1 * scale(a1) + o2 * scale(a2), m, l1 * a1 + l2 * a2


def _query_heads(q, k, v, heads):
    """k, v [B, s, K', E] (this device's kv heads) -> [B, s, H', E], each of its H' query
    heads' kv head. `heads(h)` gives the kv head (local index) of local query head h."""
    if heads is None:  # multi-head attention: k and v have the query heads already
        return k, v
    idx = heads(q.shape[2])
    return jnp.take(k, idx, axis=2), jnp.take(v, idx, axis=2)


def _documents(seg_q, seg_k):
    """The segment mask [B, 1, q, k], or None for a window packed as one stream."""
    return None if seg_q is None else (seg_q[:, :, None] == seg_k[:, None, :])[:, None]


def _and(a, b):
    return a if b is None else (b if a is None else a & b)


def _allgather(q, k, v, pos_q, seg_q=None, *, axes, heads):
    k_all = jax.lax.all_gather(k, axes, axis=1, tiled=True)
    v_all = jax.lax.all_gather(v, axes, axis=1, tiled=True)
    pos_k = jax.lax.all_gather(pos_q, axes, axis=0, tiled=True)
    seg_k = None if seg_q is None else jax.lax.all_gather(seg_q, axes, axis=1, tiled=True)
    mask = _and(pos_q[:, None] >= pos_k[None, :], _documents(seg_q, seg_k))
    o, _, l = _block(q, *_query_heads(q, k_all, v_all, heads), mask)
    return (o / jnp.swapaxes(l, 1, 2)[..., None]).astype(q.dtype)


def _ring(q, k, v, pos_q, seg_q=None, *, axes, n, heads):
    c = q.shape[1] // 2
    me = jax.lax.axis_index(axes)
    shift = [(i, (i + 1) % n) for i in range(n)]
    acc = _block(q, *_query_heads(q, k, v, heads), _and(pos_q[:, None] >= pos_q[None, :], _documents(seg_q, seg_q)))

    # The kv heads travel (with their segment ids when documents are kept apart); each
    # branch repeats them to the query heads once received.
    def early_keys(acc, q, kv):  # s < i: all 2c queries, the first c keys
        k, v = _query_heads(q, kv[0], kv[1], heads)
        mask = _documents(seg_q, None if seg_q is None else kv[2][:, :c])
        return _merge(acc, _block(q, k[:, :c], v[:, :c], mask))

    def late_queries(acc, q, kv):  # s > i: the last c queries, all 2c keys
        k, v = _query_heads(q, kv[0], kv[1], heads)
        mask = _documents(None if seg_q is None else seg_q[:, c:], None if seg_q is None else kv[2])
        o, m, l = acc
        o2, m2, l2 = _merge((o[:, c:], m[..., c:], l[..., c:]), _block(q[:, c:], k, v, mask))
        return (o.at[:, c:].set(o2), m.at[..., c:].set(m2), l.at[..., c:].set(l2))

    kv = (k, v) if seg_q is None else (k, v, seg_q)
    for j in range(1, n):
        kv = jax.lax.ppermute(kv, axes, shift)
        source = (me - j) % n
        acc = jax.lax.cond(source < me, early_keys, late_queries, acc, q, kv)
    o, _, l = acc
    return (o / jnp.swapaxes(l, 1, 2)[..., None]).astype(q.dtype)


def _kv_heads_of(spec: P, kv_spec: P, num_heads: int, num_kv: int, mesh):
    """heads(h') -> the local kv head of each of a device's h' query heads ([h'] int32), or
    None when k and v come repeated (K = H). Query head g reads kv head g // (H/K); the
    device's query heads are a contiguous block, its kv heads either the matching block
    (kv_heads split as heads are) or all K (kv_heads whole)."""
    if num_kv == num_heads:
        return None
    group = num_heads // num_kv
    axes = mesh_axes_of(spec[2])
    kv_split = kv_spec[2] is not None
    if kv_split and kv_spec[2] != spec[2]:
        raise UserError(f"Context parallelism with grouped-query attention needs kv_heads split as heads "
                        f"are, or not at all; this layout splits heads by {spec[2]} and kv_heads by "
                        f"{kv_spec[2]}. Give kv_heads the same rule as heads, or none.")

    def heads(local: int):
        rank = jax.lax.axis_index(axes) if axes and math.prod(mesh.shape[a] for a in axes) > 1 else 0
        first_kv = rank * (local // group) if kv_split else 0
        return (rank * local + jnp.arange(local)) // group - first_kv
    return heads


def attend(q_bthe, k_btke, v_btke, *, kind: str, layout: Layout, mesh, documents=None):
    """Causal attention with `length` split over devices (`splits_length`): -> [B, T, H, E].

    q [B, T, H, E], k and v [B, T, K, E] (K divides H: grouped-query attention; only the K
    kv heads travel, each device repeats them to its query heads), stored in the layout's
    zigzag order (parallel/sequence.py). A packed window's `documents` (models/documents.py)
    mask across segments too."""
    spec = layout.spec(BTHE, "activations")
    kv_spec = spec if k_btke.shape[2] == q_bthe.shape[2] else layout.spec(BTKE, "activations")
    positions_t = jnp.asarray(sequence.order(layout, mesh.shape, q_bthe.shape[1]))
    check_context_kind(kind)
    axes = mesh_axes_of(spec[1])
    n = math.prod(mesh.shape[a] for a in axes)
    if spec[3] is not None:
        raise UserError(f"Context parallelism splits heads and positions, not the head width; "
                        f"this layout splits head_dim ({spec}). Remove head_dim's rule.")
    heads = _kv_heads_of(spec, kv_spec, q_bthe.shape[2], k_btke.shape[2], mesh)
    axis = axes[0] if len(axes) == 1 else axes
    body = (functools.partial(_allgather, axes=axis, heads=heads) if kind == "allgather"
            else functools.partial(_ring, axes=axis, n=n, heads=heads))
    args, in_specs = (q_bthe, k_btke, v_btke, positions_t), (spec, kv_spec, kv_spec, P(spec[1]))
    if documents is not None:
        args, in_specs = (*args, documents.segments), (*in_specs, P(spec[0], spec[1]))
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=spec, check_vma=False)(*args)
