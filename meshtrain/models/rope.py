"""Rotary position embeddings (Su et al. 2021) in Hugging Face's "rotate_half" convention
(the two halves of a head, not interleaved pairs), with Llama 3.1's frequency scaling.

Shapes: B batch, T length, H heads, E head_dim.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Llama 3.1's frequency scaling ("rope_type": "llama3" in a Hugging Face config):
    wavelengths above original / low_freq_factor are stretched by `factor`, those below
    original / high_freq_factor are kept, and the band between is interpolated."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


def inverse_frequencies(cfg) -> np.ndarray:
    """[E/2] float32 rotation rates of a config with head_dim, rope_theta and rope_scaling,
    as transformers' `_compute_llama3_parameters` (or the default RoPE without scaling).
    Static: computed in float64 at trace time."""
    e = cfg.head_dim
    inv = 1.0 / cfg.rope_theta ** (np.arange(0, e, 2, dtype=np.float64) / e)
    s = cfg.rope_scaling
    if s is not None:
        old = s.original_max_position_embeddings
        low_wavelen, high_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
        smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)


def rope(x_bthe: jax.Array, positions_t: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotates each head's pair (i, i + E/2) by position * inv_freq[i] (rotate_half).
    positions [T] for every row, or [B, T] (a packed window's documents)."""
    angles = positions_t.astype(jnp.float32)[..., None] * inv_freq  # [(B,) T, E/2]
    angles_btf = angles if angles.ndim == 3 else angles[None]
    cos, sin = jnp.cos(angles_btf)[:, :, None], jnp.sin(angles_btf)[:, :, None]
    x1, x2 = jnp.split(x_bthe.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x_bthe.dtype)
