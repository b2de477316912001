"""What every model shares: the hooks the core passes in, stacked parameters, and the
sequential pass over a stack of layers.

A model's layers are stored stacked: each layer parameter has a leading `layers` dim,
and the forward pass runs one layer function over that dim. The caller may take that
pass over with `run_layers` (meshtrain/parallel/pipeline/scan.py does, to run the stack as pipeline
stages); the model never knows how its layers are scheduled.

    constrain: Hook                       what the model asks of its layout (models/hook.py):
                                          constrain(x, axes) pins an activation to the
                                          layout; `stored`, `natural` and `positions`
                                          read the order a sequence is stored in
    run_layers(make_layer, stacked, x, key, documents) -> x
        make_layer(constrain) -> layer(x, one layer's params, key) -> x
        documents: constrain.documents (models/documents.py) or None; a pipeline
        gives each microbatch's layers their rows
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshtrain.models import remat
from meshtrain.models.hook import Axes, Hook

BTD = ("batch", "length", "embed")

RunLayers = Callable[..., jax.Array]


def is_matrix(axes: Axes) -> bool:
    """Two or more logical axes besides the stacked layers/stage: a weight matmuls read
    (matrices and embeddings). The step casts these to the compute dtype once, and the
    optimizer decays only these."""
    return sum(a not in ("layers", "stage") for a in axes) >= 2


def stored(x: jax.Array, constrain: Hook, axis: int = 1) -> jax.Array:
    """x with its `axis` (positions 0..t-1) put in the layout's storage order: what the
    model does to its tokens and the loss to its targets. A gather of int32 ids, cheap."""
    order = constrain.order(x.shape[axis])
    return x if order is None else jnp.take(x, order, axis=axis)


def natural(x: jax.Array, constrain: Hook, axis: int = 1) -> jax.Array:
    """The inverse of `stored`: x back in position order (logits handed to a caller)."""
    order = constrain.order(x.shape[axis])
    return x if order is None else jnp.take(x, np.argsort(order), axis=axis)


def positions(constrain: Hook, t: int, pos: jax.Array | None = None) -> jax.Array:
    """The positions of a sequence's rows as stored: [t], pos..pos+t-1 when decoding (a
    cache is never reordered), else the layout's order; or [B, t] when the window is
    packed as documents (`constrain.documents`), each restarting at its document's start."""
    if pos is None and constrain.documents is not None:
        return constrain.documents.positions
    order = None if pos is not None else constrain.order(t)
    if order is not None:
        return jnp.asarray(order)
    return jnp.arange(t) + (0 if pos is None else pos)


def param(rngs: nnx.Rngs | None, shape, axes: Axes, stack: int | None, dtype, init: str = "zeros",
          std: float = 0.02) -> nnx.Param:
    """A parameter of `shape` with logical `axes` ("layers" prepended when `stack` is given).

    init: "normal" (std), "ones" or "zeros"; `rngs` is needed for "normal" only.
    """
    if stack is not None:
        shape, axes = (stack, *shape), ("layers", *axes)
    if init == "normal":
        value = std * jax.random.normal(rngs.params(), shape, dtype)
    elif init == "ones":
        value = jnp.ones(shape, dtype)
    else:
        value = jnp.zeros(shape, dtype)
    # Sharding is applied by meshtrain.step.state from these names, not eagerly by Flax.
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def vocab_table(rngs: nnx.Rngs, vocab: int, padded: int, width: int, dtype, axes: Axes) -> nnx.Param:
    """A [padded, width] table (or [width, padded] when axes start with a non-vocab name)
    of normal(0.02) rows for the `vocab` real tokens. Padding rows are zero and stay
    unused: no token maps to them and `mask_padding` masks their logits, so they get no
    gradient and the model is the unpadded one."""
    table = 0.02 * jax.random.normal(rngs.params(), (vocab, width), dtype)
    table = jnp.pad(table, ((0, padded - vocab), (0, 0)))
    table = table if axes[0] == "vocab" else table.T
    return nnx.Param(table, out_sharding=axes, eager_sharding=False)


def mask_padding(logits_btv: jax.Array, vocab: int) -> jax.Array:
    """Logits of the padding rows (ids >= vocab) at the dtype's minimum: never sampled,
    no probability mass, no gradient."""
    padded = logits_btv.shape[-1]
    if padded == vocab:
        return logits_btv
    real = jnp.arange(padded) < vocab
    return jnp.where(real, logits_btv, jnp.finfo(logits_btv.dtype).min)


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    if rate == 0.0 or key is None:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


def run_stack(layer: Callable, stacked, x: jax.Array, keys: jax.Array | None, *,
              scan: bool = True) -> jax.Array:
    """x -> layer(...layer(layer(x, stacked[0], keys[0]), stacked[1], keys[1])...).

    `stacked` is a params dict whose leaves have a leading layer dim n; `keys` is [n]
    or None. One compiled body under `lax.scan`, or unrolled.
    """
    if scan:
        x, _ = jax.lax.scan(lambda c, pk: (layer(c, *pk), None), x, (stacked, keys))
        return x
    n = jax.tree.leaves(stacked)[0].shape[0]
    for i in range(n):
        x = layer(x, *jax.tree.map(lambda a: a[i], (stacked, keys)))
    return x


def run_layers(blocks: nnx.Module, x: jax.Array, constrain: Hook, key: jax.Array | None,
               runner: RunLayers | None, *, num_layers: int, remat_policy: str, scan: bool,
               **layer_kwargs) -> jax.Array:
    """Runs a stacked module `blocks` (built with stack=num_layers) over x.

    Each layer is called as `layer_module(x, constrain, key, **layer_kwargs)`;
    `runner` (a pipeline schedule) replaces the sequential pass when given.
    """
    make_layer, stacked = layer_maker(blocks, remat_policy, **layer_kwargs)
    if runner is not None:
        return runner(make_layer, stacked, x, key, constrain.documents)
    keys = None if key is None else jax.random.split(key, num_layers)
    return run_stack(make_layer(constrain), stacked, x, keys, scan=scan)


def layer_maker(blocks: nnx.Module, remat_policy: str, **layer_kwargs):
    """A stacked module -> (make_layer, its params dict with the leading layer dim), where
    make_layer(constrain) -> layer(x, one layer's params, key) -> x under `remat_policy`."""
    graphdef, stacked = nnx.split(blocks)

    def make_layer(constrain: Hook):
        def layer(x, params, k):
            return nnx.merge(graphdef, constrain.arrive(params))(x, constrain, k, **layer_kwargs)
        return remat.wrap(layer, remat_policy, fetches=constrain.fetches)
    return make_layer, nnx.to_pure_dict(stacked)


def decode_layers(blocks: nnx.Module, x: jax.Array, constrain: Hook, cache, pos: jax.Array,
                  **layer_kwargs) -> tuple[jax.Array, object]:
    """One pass over a stacked module with a KV cache whose leaves have a leading layer dim.

    Each layer is called as `layer_module(x, constrain, None, cache=c, pos=pos, **kw)`
    and returns (x, c). -> (x, cache)
    """
    graphdef, stacked = nnx.split(blocks)
    stacked = nnx.to_pure_dict(stacked)

    def body(x, params_cache):
        params, c = params_cache
        return nnx.merge(graphdef, params)(x, constrain, None, cache=c, pos=pos, **layer_kwargs)
    return jax.lax.scan(body, x, (stacked, cache))


def pre_norm_block(x_btd: jax.Array, constrain: Hook, key: jax.Array | None, *, norm1, attn,
                   norm2, mlp, rate: float, cache=None, pos: jax.Array | None = None):
    """x + attn(norm1(x)), then + mlp(norm2(...)), with dropout on each branch and the
    residual pinned to (batch, length, embed): the pre-norm transformer block.

    x [B, T, D] -> x; with a KV cache (decoding: attn returns (y, cache)) -> (x, cache).
    """
    keys = (None, None) if key is None else tuple(jax.random.split(key))
    a = attn(constrain.gather_sequence(norm1(x_btd)), constrain, cache, pos)
    a, cache = a if cache is not None else (a, None)
    x_btd = constrain(x_btd + dropout(a, rate, keys[0]), BTD)
    x_btd = x_btd + dropout(mlp(constrain.gather_sequence(norm2(x_btd)), constrain), rate, keys[1])
    x_btd = constrain(x_btd, BTD)
    return x_btd if cache is None else (x_btd, cache)
