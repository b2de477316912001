"""Causal dot-product attention, with or without a KV cache (shared by the models).

Shapes: B batch, T query positions, S cache positions, H query heads, K key/value
heads (K divides H: grouped-query attention when K < H), E head width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Cache = tuple[jax.Array, jax.Array]  # (k [B, S, K, E], v [B, S, K, E])


def attend(q_bthe: jax.Array, k_btke: jax.Array, v_btke: jax.Array,
           cache: Cache | None = None, pos: jax.Array | None = None) -> tuple[jax.Array, Cache | None]:
    """-> (out [B, T, H, E], cache).

    Without a cache, position i attends to positions <= i of this call. With one,
    k and v are written at cache positions pos..pos+T-1 and query i (at position
    pos + i) attends to cache positions <= pos + i; the rest of the cache is masked.
    """
    if cache is None:
        return jax.nn.dot_product_attention(q_bthe, k_btke, v_btke, is_causal=True), None
    ck, cv = cache
    ck = jax.lax.dynamic_update_slice_in_dim(ck, k_btke.astype(ck.dtype), pos, axis=1)
    cv = jax.lax.dynamic_update_slice_in_dim(cv, v_btke.astype(cv.dtype), pos, axis=1)
    t, s = q_bthe.shape[1], ck.shape[1]
    mask_ts = jnp.arange(s)[None, :] <= pos + jnp.arange(t)[:, None]
    out = jax.nn.dot_product_attention(q_bthe, ck.astype(q_bthe.dtype), cv.astype(q_bthe.dtype),
                                       mask=mask_ts[None, None])
    return out, (ck, cv)
