"""Where a sequence's positions live when a layout splits them: context parallelism's
order, and sequence parallelism's two pins.

A layout splits `length` inside attention when the activation spec of q, k and v
([batch, length, heads, head_dim]) puts mesh axes on `length` (`length:context` in the
*_cp presets). Sequence parallelism's `length:tensor` does not: heads claim tensor first
there, so attention sees whole sequences.

Causal attention over n contiguous pieces would leave the first device idle on masked
blocks while the last works on all of them. So the sequence is cut into 2n equal chunks
and device i holds chunks i and 2n-1-i, one early and one late (the "zigzag" order of
Brandon et al. 2023, Striped/Ring Attention; Llama 3's context parallelism, Dubey et al.
2024 §3.3.2): every device then has the same unmasked work. The model reads its tokens
in this order, computes its positions from it, and the loss reads the targets in it, so
nothing between embedding and loss is ever re-sorted.

  order(layout, shape, t)  -> positions [t] in storage order, or None (natural order)
  split(layout, shape)     -> (n, mesh axes) of attention's `length`
  check(layout, shape, t)  a UserError unless 2n divides t
  for_attention(layout, axes)  the spec of `axes` with `length` split only as attention
                           splits it: attention's and the MLP's input under sequence
                           parallelism (Megatron's all-gather, `sequence_gather` below)

For n = 2 and t = 8: chunks [0 1][2 3][4 5][6 7]; device 0 holds positions 0 1 6 7,
device 1 holds 2 3 4 5; order = [0 1 6 7 2 3 4 5].

Under sequence parallelism (`length:tensor` in the residual stream) the stream holds a
slice of the positions on each tensor rank while attention and the MLP see whole
sequences; `as_attention_sees` and `sequence_gather` say where that changes hands.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshtrain.errors import UserError
from meshtrain.parallel.layouts.rules import Layout, mesh_axes_of

ATTENTION_AXES = ("batch", "length", "heads", "head_dim")
BTD = ("batch", "length", "embed")


def split(layout: Layout, shape: Mapping[str, int]) -> tuple[int, tuple[str, ...]]:
    """How many pieces attention's `length` is cut into, and over which mesh axes."""
    return layout.split(ATTENTION_AXES, "length", shape)


def balanced(t: int, n: int) -> np.ndarray:
    """The zigzag order of t positions over n devices (module docstring): [t] int32."""
    chunks = np.arange(t, dtype=np.int32).reshape(2 * n, t // (2 * n))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * n - 1 - i]]) for i in range(n)])


def check(layout: Layout, shape: Mapping[str, int], t: int) -> None:
    n, axes = split(layout, shape)
    if n > 1 and t % (2 * n):
        raise UserError(
            f"model.seq_len={t} cannot be split over {'+'.join(axes)}={n}: context parallelism "
            f"cuts the sequence into 2 x {n} = {2 * n} equal chunks (each device holds an early "
            f"and a late one, so causal attention's work is balanced), and {2 * n} does not "
            f"divide {t}. Use a seq_len divisible by {2 * n}, or a smaller {'+'.join(axes)} axis.")


def order(layout: Layout, shape: Mapping[str, int], t: int) -> np.ndarray | None:
    """Positions in the order the devices store them, or None when attention's `length`
    is whole (natural order)."""
    n, _ = split(layout, shape)
    if n == 1:
        return None
    check(layout, shape, t)
    return balanced(t, n)


def for_attention(layout: Layout, axes) -> P:
    """The activation spec of `axes` (which name `length`) with the positions split over
    attention's length axes only: under sequence parallelism `length:tensor` is dropped
    (the pieces are gathered), `length:context` kept."""
    spec = layout.spec(axes, "activations")
    keep = set(mesh_axes_of(layout.spec(ATTENTION_AXES, "activations")[1]))
    i = list(axes).index("length")
    entry = tuple(a for a in mesh_axes_of(spec[i]) if a in keep)
    return P(*spec[:i], None if not entry else entry[0] if len(entry) == 1 else entry, *spec[i + 1:])


def as_attention_sees(x: jax.Array, layout: Layout, mesh, axes) -> jax.Array:
    """x pinned to the layout's spec for `axes` with its positions split only as attention
    splits them (the layout's own spec where the two agree, as without sequence parallelism)."""
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, for_attention(layout, axes)))


def sequence_gather(x_btd: jax.Array, layout: Layout, mesh) -> jax.Array:
    """Megatron's `g` under sequence parallelism (Korthikanti et al. 2022, §4.2.2): the
    input of attention or the MLP, split by position over tensor in the residual stream, is
    all-gathered whole in the forward pass, and its gradient, a partial sum on each tensor
    rank, is reduce-scattered back to the split in the backward pass. Left to itself, XLA
    moved q, k and v by all-to-all and gathered weights instead. A no-op unless the layout
    splits the stream's positions more than attention's (x [B, T, D])."""
    attention_spec, stream_spec = for_attention(layout, BTD), layout.spec(BTD, "activations")
    if attention_spec == stream_spec:
        return x_btd
    whole, stream = NamedSharding(mesh, attention_spec), NamedSharding(mesh, stream_spec)

    @jax.custom_vjp
    def gather(x):
        return jax.lax.with_sharding_constraint(x, whole)

    def gather_fwd(x):
        return gather(x), None

    def gather_bwd(_, dy):
        return (jax.lax.with_sharding_constraint(dy, stream),)

    gather.defvjp(gather_fwd, gather_bwd)
    return gather(x_btd)
