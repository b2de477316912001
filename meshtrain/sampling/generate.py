"""Autoregressive generation with a KV cache, jitted once, on the run's mesh and layout.

    fn = make_generate(model, layout, mesh, param_shardings, max_new_tokens=N)
    tokens = generate(fn, params, prompts [n, P], layout, mesh, seed=, temperature=, ...)
        -> [n, N] int32

One compiled program does the whole generation: a prefill of the prompt (one
`decode` over P positions fills the cache), then a `lax.fori_loop` of N - 1
one-token decodes. The sampling knobs (seed, temperature, top_k, top_p) are traced
scalars, so changing them reuses the program; only the shapes (rows, P, N) recompile.

Sharding: prompts and outputs are split over the batch like the training batch;
the cache [L, B, S, K, E] is pinned with logical axes (layers, batch, length,
heads or kv_heads, head_dim) under the layout's activation rules, so under tensor
parallelism each device holds the cache of its own heads. Rows are padded up to a
multiple of the batch shards (copies of row 0) and the extras dropped. Where the layout
splits the cache's `length` (`length:context` under context parallelism; Llama's cache
under sequence parallelism, whose K heads leave `tensor` to `length`), each device holds
a contiguous piece of the positions (decoding never reorders them) and S is rounded up to
a multiple of the pieces (`cache_length`): the extra positions are never written, always
masked. Each step's attention then reduces over those devices (docs/layouts.md, "Long
sequences").

Shapes: n samples, B padded rows, P prompt length, N new tokens, V vocab (padded),
L layers, S = P + N cache positions (rounded up: `cache_length`), K key/value heads, E head width.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from meshtrain.parallel.hook import Constrain
from meshtrain.parallel.layouts import Layout
from meshtrain.step.state import ModelDef
from meshtrain.step.train_step import batch_sharding


def batch_shards(layout: Layout, mesh: Mesh) -> int:
    """How many pieces the activations' batch is split into (rows must be a multiple)."""
    return layout.shards("batch", mesh.shape)[0]


def cache_pieces(model: ModelDef, layout: Layout, mesh: Mesh) -> int:
    """How many pieces the layout splits the KV cache's `length` into (1: whole)."""
    axes = model.bind(model.shapes).cache_axes()[0]  # k's axes; v's are the same
    return layout.split(axes, "length", mesh.shape)[0]


def cache_length(model: ModelDef, layout: Layout, mesh: Mesh, length: int) -> int:
    """The KV cache's positions for `length` (prompt + new tokens): rounded up to a multiple
    of `cache_pieces`, so each device holds as many."""
    pieces = cache_pieces(model, layout, mesh)
    return -(-length // pieces) * pieces


def padded_rows(n: int, layout: Layout, mesh: Mesh) -> int:
    shards = batch_shards(layout, mesh)
    return -(-n // shards) * shards


def sample_logits(logits_bv: jax.Array, key: jax.Array, temperature, top_k, top_p) -> jax.Array:
    """logits [B, V] -> next token [B] int32.

    temperature 0 is greedy (argmax). Otherwise logits / temperature, keep the top_k
    largest (0: all), then the smallest set whose probability reaches top_p (1: all;
    ties at a cut are kept), and draw. All knobs may be traced.
    """
    x = logits_bv.astype(jnp.float32)
    greedy = jnp.argmax(x, axis=-1).astype(jnp.int32)
    v = x.shape[-1]
    x = x / jnp.where(temperature > 0, temperature, 1.0)
    # One descending sort serves both filters; a filter is a threshold on the values.
    sorted_bv = -jnp.sort(-x, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    kth_b1 = jax.lax.dynamic_slice_in_dim(sorted_bv, k - 1, 1, axis=-1)
    sorted_bv = jnp.where(sorted_bv >= kth_b1, sorted_bv, -jnp.inf)
    probs_bv = jax.nn.softmax(sorted_bv, axis=-1)
    before_bv = jnp.cumsum(probs_bv, axis=-1) - probs_bv  # mass of the larger tokens
    keep = (before_bv < top_p) | (top_p >= 1.0)
    last_b = jnp.maximum(jnp.sum(keep & (sorted_bv > -jnp.inf), axis=-1), 1) - 1
    cut_b1 = jnp.take_along_axis(sorted_bv, last_b[:, None], axis=-1)
    x = jnp.where(x >= cut_b1, x, -jnp.inf)
    drawn = jax.random.categorical(key, x, axis=-1).astype(jnp.int32)
    return jnp.where(temperature > 0, drawn, greedy)


def make_generate(model: ModelDef, layout: Layout, mesh: Mesh, param_shardings, *,
                  max_new_tokens: int) -> Callable:
    """The jitted generation:

        fn(params, prompts [B, P] int32, seed [] int32, temperature [] f32, top_k [] int32,
           top_p [] f32) -> new tokens [B, N] int32

    B must be a multiple of `batch_shards(layout, mesh)` (see `generate`), and
    P + N at most `model.cfg.max_context()` (past seq_len only where the positions are
    computed, as Llama's RoPE). `model` is unpipelined: decoding runs the
    layers in order on every device of a stage (see docs/sampling.md).
    """
    if model.pipeline is not None:
        raise ValueError("generation runs the layers in order: build the ModelDef without a pipeline")
    n_new = max_new_tokens
    constrain = Constrain(layout, mesh)
    rows = batch_sharding(layout, mesh)
    pieces = cache_pieces(model, layout, mesh)
    replicated = NamedSharding(mesh, P())

    def run(params, prompt_bp, seed, temperature, top_k, top_p):
        module = model.bind(params)
        b, p = prompt_bp.shape
        key = jax.random.key(seed)
        cache = module.init_cache(b, -(-(p + n_new) // pieces) * pieces)  # cache_length
        # The axes attention pins k and v to, so the cache is never resharded in the loop.
        axes = module.cache_axes()

        def pin(c):
            return jax.tree.map(constrain, c, axes)

        def next_token(logits_btv, i):
            # The last position's logits, whole vocabulary per row: the sort is local.
            last_bv = constrain(logits_btv[:, -1].astype(jnp.float32), ("batch", None))
            return sample_logits(last_bv, jax.random.fold_in(key, i), temperature, top_k, top_p)

        logits, cache = module.decode(prompt_bp, pin(cache), jnp.int32(0), constrain)
        out_bn = jnp.zeros((b, n_new), jnp.int32).at[:, 0].set(next_token(logits, 0))

        def step(i, carry):
            out_bn, cache = carry
            tok_b1 = jax.lax.dynamic_slice_in_dim(out_bn, i - 1, 1, axis=1)
            logits, cache = module.decode(tok_b1, cache, p + i - 1, constrain)
            out_bn = jax.lax.dynamic_update_slice_in_dim(out_bn, next_token(logits, i)[:, None], i, axis=1)
            return constrain(out_bn, ("batch", None)), pin(cache)

        out_bn, _ = jax.lax.fori_loop(1, n_new, step, (out_bn, pin(cache)))
        return out_bn

    return jax.jit(run, in_shardings=(param_shardings, rows) + (replicated,) * 4,
                   out_shardings=rows)


def compile_generate(fn: Callable, params, rows: int, prompt_len: int, layout: Layout, mesh: Mesh):
    """AOT-compiles `make_generate`'s function for [rows, prompt_len] prompts; `generate`
    takes either (the CLI compiles first to time the compile apart from the run)."""
    replicated = NamedSharding(mesh, P())
    prompts = jax.ShapeDtypeStruct((rows, prompt_len), jnp.int32, sharding=batch_sharding(layout, mesh))
    scalars = [jax.ShapeDtypeStruct((), dt, sharding=replicated)
               for dt in (jnp.int32, jnp.float32, jnp.int32, jnp.float32)]
    return fn.lower(params, prompts, *scalars).compile()


def generate(fn: Callable, params, prompts: np.ndarray, layout: Layout, mesh: Mesh, *,
             seed: int = 0, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """prompts [n, P] (host ints) -> new tokens [n, N] (host int32), rows padded to the
    batch shards for the call and dropped after."""
    prompts = np.asarray(prompts, np.int32)
    n = prompts.shape[0]
    b = padded_rows(n, layout, mesh)
    padded = np.concatenate([prompts, np.repeat(prompts[:1], b - n, axis=0)])
    out = fn(params, jax.device_put(padded, batch_sharding(layout, mesh)), np.int32(seed), np.float32(temperature),
             np.int32(top_k), np.float32(top_p))
    return np.asarray(jax.device_get(out))[:n]
