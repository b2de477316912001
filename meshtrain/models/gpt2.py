"""GPT-2 in Flax NNX, written with logical axis names only.

Every parameter carries its logical axes in `out_sharding` metadata; activations
are pinned at block boundaries through the `constrain(x, axes)` callback the
caller passes in (identity by default). The model knows nothing of meshes.

Blocks are stored stacked: each block parameter has a leading `layers` axis, and
the forward pass runs the block `num_layers` times, by `lax.scan` (one compiled
body) or unrolled (`scan_layers=False`); both read the same parameters. A caller
may take over that pass with `run_layers` (meshtrain/pipeline.py does, to run the
stack as pipeline stages); the model does not know how its layers are scheduled.

Shapes: B batch, T length, D embed, H heads, E head_dim, F mlp, V vocab (padded),
L layers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from meshtrain.models import remat

Axes = tuple[str | None, ...]
Constrain = Callable[[jax.Array, Axes], jax.Array]
# run_layers(make_layer, stacked params, x [B, T, D], key) -> [B, T, D], where
# make_layer(constrain) -> layer(x, one layer's params, key) -> x.
RunLayers = Callable[..., jax.Array]


def no_constraint(x: jax.Array, axes: Axes) -> jax.Array:
    del axes
    return x


@dataclasses.dataclass(frozen=True)
class GPT2Config:
    num_layers: int
    num_heads: int
    embed_dim: int
    mlp_dim: int
    vocab_size: int          # tokens the data can produce
    padded_vocab_size: int   # rows of the embedding table (>= vocab_size); extra rows are inert
    seq_len: int             # context length = rows of the learned position table
    dropout: float = 0.0
    dtype: str = "float32"        # compute dtype
    param_dtype: str = "float32"  # storage dtype of parameters and optimizer state
    remat: str = "none"           # see models/remat.py
    scan_layers: bool = True

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads


def num_params(cfg: GPT2Config, vocab_size: int | None = None) -> int:
    """Closed form: L (12 D^2 + 13 D) + V D + T D + 2 D (tied embedding)."""
    d, v = cfg.embed_dim, cfg.vocab_size if vocab_size is None else vocab_size
    per_layer = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * cfg.mlp_dim + cfg.mlp_dim) + (cfg.mlp_dim * d + d)
    return cfg.num_layers * per_layer + v * d + cfg.seq_len * d + 2 * d


def _param(rngs: nnx.Rngs | None, shape, axes: Axes, stack: int | None, dtype, init: str,
           std: float = 0.02) -> nnx.Param:
    """A parameter of `shape` (with a leading `layers` dim of size `stack` if given)."""
    if stack is not None:
        shape, axes = (stack, *shape), ("layers", *axes)
    if init == "normal":
        value = std * jax.random.normal(rngs.params(), shape, dtype)
    elif init == "ones":
        value = jnp.ones(shape, dtype)
    else:
        value = jnp.zeros(shape, dtype)
    # Sharding is applied by meshtrain.state from these names, not eagerly by Flax.
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


class LayerNorm(nnx.Module):
    def __init__(self, cfg: GPT2Config, stack: int | None = None):
        dt = jnp.dtype(cfg.param_dtype)
        self.scale = _param(None, (cfg.embed_dim,), ("embed",), stack, dt, "ones")
        self.bias = _param(None, (cfg.embed_dim,), ("embed",), stack, dt, "zeros")

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        # Statistics in float32 whatever the compute dtype.
        x = x_btd.astype(jnp.float32)
        mean = x.mean(-1, keepdims=True)
        var = jnp.square(x - mean).mean(-1, keepdims=True)
        y = (x - mean) * jax.lax.rsqrt(var + 1e-5) * self.scale[...] + self.bias[...]
        return y.astype(x_btd.dtype)


def _dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    if rate == 0.0 or key is None:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: GPT2Config, rngs: nnx.Rngs, stack: int | None = None):
        d, h, e = cfg.embed_dim, cfg.num_heads, cfg.head_dim
        dt = jnp.dtype(cfg.param_dtype)
        # Head-aligned [D, 3, H, E]: splitting heads over a mesh axis needs no
        # reshuffle of a fused [D, 3D] matrix.
        self.w_qkv = _param(rngs, (d, 3, h, e), ("embed", None, "heads", "head_dim"), stack, dt, "normal")
        self.b_qkv = _param(rngs, (3, h, e), (None, "heads", "head_dim"), stack, dt, "zeros")
        # GPT-2: residual projections scaled by 1/sqrt(2L).
        std_out = 0.02 / math.sqrt(2 * cfg.num_layers)
        self.w_out = _param(rngs, (h, e, d), ("heads", "head_dim", "embed"), stack, dt, "normal", std_out)
        self.b_out = _param(rngs, (d,), ("embed",), stack, dt, "zeros")
        self.cfg = cfg

    def __call__(self, x_btd: jax.Array, constrain: Constrain) -> jax.Array:
        dt = x_btd.dtype
        qkv = jnp.einsum("btd,dkhe->btkhe", x_btd, self.w_qkv[...].astype(dt)) + self.b_qkv[...].astype(dt)
        q, k, v = (constrain(qkv[:, :, i], ("batch", "length", "heads", "head_dim")) for i in range(3))
        o_bthe = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        o_bthe = constrain(o_bthe, ("batch", "length", "heads", "head_dim"))
        return jnp.einsum("bthe,hed->btd", o_bthe, self.w_out[...].astype(dt)) + self.b_out[...].astype(dt)


class MLP(nnx.Module):
    def __init__(self, cfg: GPT2Config, rngs: nnx.Rngs, stack: int | None = None):
        d, f = cfg.embed_dim, cfg.mlp_dim
        dt = jnp.dtype(cfg.param_dtype)
        self.w_fc = _param(rngs, (d, f), ("embed", "mlp"), stack, dt, "normal")
        self.b_fc = _param(rngs, (f,), ("mlp",), stack, dt, "zeros")
        std_out = 0.02 / math.sqrt(2 * cfg.num_layers)
        self.w_proj = _param(rngs, (f, d), ("mlp", "embed"), stack, dt, "normal", std_out)
        self.b_proj = _param(rngs, (d,), ("embed",), stack, dt, "zeros")

    def __call__(self, x_btd: jax.Array, constrain: Constrain) -> jax.Array:
        dt = x_btd.dtype
        h_btf = x_btd @ self.w_fc[...].astype(dt) + self.b_fc[...].astype(dt)
        h_btf = constrain(jax.nn.gelu(h_btf, approximate=True), ("batch", "length", "mlp"))
        return h_btf @ self.w_proj[...].astype(dt) + self.b_proj[...].astype(dt)


class Block(nnx.Module):
    """Pre-LayerNorm transformer block; built with `stack=L` it holds L blocks' weights."""

    def __init__(self, cfg: GPT2Config, rngs: nnx.Rngs, stack: int | None = None):
        self.ln1 = LayerNorm(cfg, stack)
        self.attn = Attention(cfg, rngs, stack)
        self.ln2 = LayerNorm(cfg, stack)
        self.mlp = MLP(cfg, rngs, stack)
        self.dropout = cfg.dropout

    def __call__(self, x_btd: jax.Array, constrain: Constrain, key: jax.Array | None) -> jax.Array:
        keys = (None, None) if key is None else tuple(jax.random.split(key))
        x_btd = x_btd + _dropout(self.attn(self.ln1(x_btd), constrain), self.dropout, keys[0])
        x_btd = constrain(x_btd, ("batch", "length", "embed"))
        x_btd = x_btd + _dropout(self.mlp(self.ln2(x_btd), constrain), self.dropout, keys[1])
        return constrain(x_btd, ("batch", "length", "embed"))


class GPT2(nnx.Module):
    def __init__(self, cfg: GPT2Config, rngs: nnx.Rngs):
        dt = jnp.dtype(cfg.param_dtype)
        self.cfg = cfg
        wte = 0.02 * jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.embed_dim), dt)
        # Padding rows are zero and stay unused: no token maps to them and their
        # logits are masked, so they get no gradient and the model is the unpadded one.
        wte = jnp.pad(wte, ((0, cfg.padded_vocab_size - cfg.vocab_size), (0, 0)))
        self.wte = nnx.Param(wte, out_sharding=("vocab", "embed"), eager_sharding=False)
        self.wpe = _param(rngs, (cfg.seq_len, cfg.embed_dim), ("length", "embed"), None, dt, "normal", 0.01)
        self.blocks = Block(cfg, rngs, stack=cfg.num_layers)
        self.ln_f = LayerNorm(cfg)

    def __call__(self, tokens_bt: jax.Array, constrain: Constrain = no_constraint,
                 key: jax.Array | None = None, run_layers: RunLayers | None = None) -> jax.Array:
        """tokens [B, T] int32 -> logits [B, T, V] in the compute dtype.

        `run_layers` replaces the sequential pass over the block stack (the pipeline
        passes its schedule here); the default runs the layers in order.
        """
        cfg = self.cfg
        dt = jnp.dtype(cfg.dtype)
        t = tokens_bt.shape[1]
        keys = (None, None) if key is None else tuple(jax.random.split(key))
        # The table as compute wants it (gathered over FSDP, split over vocab under
        # TP), used for both the lookup and the tied output projection.
        wte_vd = constrain(self.wte[...], ("vocab", "embed"))
        x_btd = jnp.take(wte_vd, tokens_bt, axis=0) + self.wpe[...][:t]
        x_btd = _dropout(x_btd.astype(dt), cfg.dropout, keys[0])
        x_btd = constrain(x_btd, ("batch", "length", "embed"))
        x_btd = self._run_blocks(x_btd, constrain, keys[1], run_layers)
        x_btd = self.ln_f(x_btd)
        logits_btv = jnp.einsum("btd,vd->btv", x_btd, wte_vd.astype(dt))
        if cfg.padded_vocab_size > cfg.vocab_size:
            real = jnp.arange(cfg.padded_vocab_size) < cfg.vocab_size
            logits_btv = jnp.where(real, logits_btv, jnp.finfo(dt).min)
        return constrain(logits_btv, ("batch", "length", "vocab"))

    def _run_blocks(self, x_btd: jax.Array, constrain: Constrain, key: jax.Array | None,
                    run_layers: RunLayers | None) -> jax.Array:
        graphdef, stacked = nnx.split(self.blocks)
        stacked = nnx.to_pure_dict(stacked)
        remat_policy = self.cfg.remat

        def make_layer(constrain: Constrain):
            def layer(x, params, k):
                return nnx.merge(graphdef, params)(x, constrain, k)
            return remat.wrap(layer, remat_policy)

        if run_layers is not None:
            return run_layers(make_layer, stacked, x_btd, key)
        keys = None if key is None else jax.random.split(key, self.cfg.num_layers)
        return run_stack(make_layer(constrain), stacked, x_btd, keys, scan=self.cfg.scan_layers)


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
