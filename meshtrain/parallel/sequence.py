"""Sequence parallelism's two pins, written with the hook's specs (parallel/hook.py).

Under sequence parallelism (`length:tensor` in the residual stream, layouts/sequence.py)
the stream holds a slice of the positions on each tensor rank while attention and the
MLP see whole sequences. These say where that changes hands.
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding

from meshtrain.parallel.hook import Axes, Constrain

BTD = ("batch", "length", "embed")


def as_attention_sees(x: jax.Array, constrain: Constrain, axes: Axes) -> jax.Array:
    """x pinned to the layout's spec for `axes` with its positions split only as attention
    splits them (`constrain(x, axes)` where the two agree, as without sequence parallelism)."""
    if not constrain.sharded:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(constrain.mesh, constrain.for_attention(axes)))


def sequence_gather(x_btd: jax.Array, constrain: Constrain) -> jax.Array:
    """Megatron's `g` under sequence parallelism (Korthikanti et al. 2022, §4.2.2): the
    input of attention or the MLP, split by position over tensor in the residual stream, is
    all-gathered whole in the forward pass, and its gradient, a partial sum on each tensor
    rank, is reduce-scattered back to the split in the backward pass. Left to itself, XLA
    moved q, k and v by all-to-all and gathered weights instead. A no-op unless the layout
    splits the stream's positions more than attention's (x [B, T, D])."""
    if not constrain.sharded or constrain.for_attention(BTD) == constrain.spec(BTD):
        return x_btd
    whole, stream = (NamedSharding(constrain.mesh, s) for s in (constrain.for_attention(BTD), constrain.spec(BTD)))

    @jax.custom_vjp
    def gather(x):
        return jax.lax.with_sharding_constraint(x, whole)

    def gather_fwd(x):
        return gather(x), None

    def gather_bwd(_, dy):
        return (jax.lax.with_sharding_constraint(dy, stream),)

    gather.defvjp(gather_fwd, gather_bwd)
    return gather(x_btd)
