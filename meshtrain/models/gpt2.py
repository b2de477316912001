"""GPT-2 in Flax NNX, written with logical axis names only (Radford et al. 2019).

Every parameter carries its logical axes in `out_sharding` metadata; activations
are pinned at block boundaries through the `constrain(x, axes)` callback the
caller passes in (identity by default). The model knows nothing of meshes.

Blocks are stored stacked (models/stack.py): each block parameter has a leading
`layers` axis, run by `lax.scan` or unrolled, or by the caller's `run_layers`.

Shapes: B batch, T length, D embed, H heads, E head_dim, F mlp, V vocab (padded),
L layers.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from meshtrain.errors import UserError
from meshtrain.models import family, sizes
from meshtrain.models import stack
from meshtrain.models.attention import Cache, attend
from meshtrain.models.hook import UNSHARDED, Hook
from meshtrain.models.stack import RunLayers, dropout as _dropout, param


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPT2Config(family.ModelConfig):
    num_heads: int
    embed_dim: int
    mlp_dim: int

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    def max_context(self) -> tuple[int, str]:
        return self.seq_len, (f"GPT-2 learns one embedding per position, and its position table "
                              f"(wpe) has model.seq_len={self.seq_len} rows, so there is no "
                              f"position past {self.seq_len} to decode at (a RoPE model such as "
                              f"llama computes its positions and can go further)")


def num_params(cfg: GPT2Config, vocab_size: int | None = None) -> int:
    """Closed form: L (12 D^2 + 13 D) + V D + T D + 2 D (tied embedding)."""
    d, v = cfg.embed_dim, cfg.vocab_size if vocab_size is None else vocab_size
    per_layer = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * cfg.mlp_dim + cfg.mlp_dim) + (cfg.mlp_dim * d + d)
    return cfg.num_layers * per_layer + v * d + cfg.seq_len * d + 2 * d



def _layer_norm(x_btd: jax.Array, scale_d: jax.Array, bias_d: jax.Array) -> jax.Array:
    # Statistics in float32 whatever the compute dtype.
    x = x_btd.astype(jnp.float32)
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    y = (x - mean) * jax.lax.rsqrt(var + 1e-5) * scale_d + bias_d
    return y.astype(x_btd.dtype)


def _gelu(h: jax.Array) -> jax.Array:
    # The tanh approximation: Hugging Face's gelu_new, GPT-2's activation.
    return jax.nn.gelu(h, approximate=True)


# Element-wise pieces whose backward pass recomputes them, output included, from their
# input, the one array they keep: autodiff of the plain functions keeps its intermediates
# (five [B, T, F] arrays per GELU: the tanh, products of x, ...; two [B, T, D] and the
# statistics per LayerNorm), and on a CPU, where this step is bound by memory traffic,
# writing and reading those back costs more than recomputing them (docs/benchmarks.md,
# "CPU step"). The same operations, so the same numbers.
# prevent_cse=False: under the layer scan, CSE cannot merge the recomputation back into
# the forward pass, and the barriers that prevent it cost 6% of the CPU step; unrolled,
# XLA may merge them, which keeps the forward values alive as before, no worse.
layer_norm = jax.checkpoint(_layer_norm, prevent_cse=False)
gelu = jax.checkpoint(_gelu, prevent_cse=False)


class LayerNorm(nnx.Module):
    def __init__(self, cfg: GPT2Config, stack: int | None = None):
        dt = jnp.dtype(cfg.param_dtype)
        self.scale = param(None, (cfg.embed_dim,), ("embed",), stack, dt, "ones")
        self.bias = param(None, (cfg.embed_dim,), ("embed",), stack, dt, "zeros")

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        return layer_norm(x_btd, self.scale[...], self.bias[...])


class Attention(nnx.Module):
    def __init__(self, cfg: GPT2Config, rngs: nnx.Rngs, stack: int | None = None):
        d, h, e = cfg.embed_dim, cfg.num_heads, cfg.head_dim
        dt = jnp.dtype(cfg.param_dtype)
        # Head-aligned [D, 3, H, E]: splitting heads over a mesh axis needs no
        # reshuffle of a fused [D, 3D] matrix.
        self.w_qkv = param(rngs, (d, 3, h, e), ("embed", None, "heads", "head_dim"), stack, dt, "normal")
        self.b_qkv = param(rngs, (3, h, e), (None, "heads", "head_dim"), stack, dt, "zeros")
        # GPT-2: residual projections scaled by 1/sqrt(2L).
        std_out = 0.02 / math.sqrt(2 * cfg.num_layers)
        self.w_out = param(rngs, (h, e, d), ("heads", "head_dim", "embed"), stack, dt, "normal", std_out)
        self.b_out = param(rngs, (d,), ("embed",), stack, dt, "zeros")
        self.cfg = cfg

    def __call__(self, x_btd: jax.Array, constrain: Hook, cache: Cache | None = None,
                 pos: jax.Array | None = None):
        """x [B, T, D] -> [B, T, D]; with a KV cache (see attention.attend) -> (y, cache)."""
        dt = x_btd.dtype
        qkv = jnp.einsum("btd,dkhe->btkhe", x_btd, self.w_qkv[...].astype(dt)) + self.b_qkv[...].astype(dt)
        qkv = checkpoint_name(qkv, "qkv")
        q, k, v = (constrain(qkv[:, :, i], ("batch", "length", "heads", "head_dim")) for i in range(3))
        o_bthe, cache = attend(q, k, v, cache, pos, implementation=self.cfg.attention,
                               constrain=constrain, context=self.cfg.context_attention)
        o_bthe = constrain(o_bthe, ("batch", "length", "heads", "head_dim"))
        y = jnp.einsum("bthe,hed->btd", o_bthe, self.w_out[...].astype(dt)) + self.b_out[...].astype(dt)
        y = checkpoint_name(y, "attn_out")
        return y if cache is None else (y, cache)


class MLP(nnx.Module):
    def __init__(self, cfg: GPT2Config, rngs: nnx.Rngs, stack: int | None = None):
        d, f = cfg.embed_dim, cfg.mlp_dim
        dt = jnp.dtype(cfg.param_dtype)
        self.w_fc = param(rngs, (d, f), ("embed", "mlp"), stack, dt, "normal")
        self.b_fc = param(rngs, (f,), ("mlp",), stack, dt, "zeros")
        std_out = 0.02 / math.sqrt(2 * cfg.num_layers)
        self.w_proj = param(rngs, (f, d), ("mlp", "embed"), stack, dt, "normal", std_out)
        self.b_proj = param(rngs, (d,), ("embed",), stack, dt, "zeros")

    def __call__(self, x_btd: jax.Array, constrain: Hook) -> jax.Array:
        dt = x_btd.dtype
        h_btf = checkpoint_name(x_btd @ self.w_fc[...].astype(dt) + self.b_fc[...].astype(dt), "mlp_up")
        h_btf = constrain(gelu(h_btf), ("batch", "length", "mlp"))
        return checkpoint_name(h_btf @ self.w_proj[...].astype(dt) + self.b_proj[...].astype(dt), "mlp_down")


class Block(nnx.Module):
    """Pre-LayerNorm transformer block; built with `stack=L` it holds L blocks' weights."""

    def __init__(self, cfg: GPT2Config, rngs: nnx.Rngs, stack: int | None = None):
        self.ln1 = LayerNorm(cfg, stack)
        self.attn = Attention(cfg, rngs, stack)
        self.ln2 = LayerNorm(cfg, stack)
        self.mlp = MLP(cfg, rngs, stack)
        self.dropout = cfg.dropout

    def __call__(self, x_btd: jax.Array, constrain: Hook, key: jax.Array | None,
                 cache: Cache | None = None, pos: jax.Array | None = None):
        """x [B, T, D] -> x; with a KV cache (decoding, no dropout) -> (x, cache)."""
        return stack.pre_norm_block(x_btd, constrain, key, norm1=self.ln1, attn=self.attn, norm2=self.ln2,
                                    mlp=self.mlp, rate=self.dropout, cache=cache, pos=pos)


class GPT2(nnx.Module):
    def __init__(self, cfg: GPT2Config, rngs: nnx.Rngs):
        dt = jnp.dtype(cfg.param_dtype)
        self.cfg = cfg
        self.wte = stack.vocab_table(rngs, cfg.vocab_size, cfg.padded_vocab_size, cfg.embed_dim, dt,
                                     ("vocab", "embed"))
        self.wpe = param(rngs, (cfg.seq_len, cfg.embed_dim), ("length", "embed"), None, dt, "normal", 0.01)
        self.blocks = Block(cfg, rngs, stack=cfg.num_layers)
        self.ln_f = LayerNorm(cfg)

    def __call__(self, tokens_bt: jax.Array, constrain: Hook = UNSHARDED,
                 key: jax.Array | None = None, run_layers: RunLayers | None = None) -> jax.Array:
        """tokens [B, T] int32 -> logits [B, T, V] in the compute dtype.

        `run_layers` replaces the sequential pass over the block stack (the pipeline
        passes its schedule here); the default runs the layers in order.
        """
        logits_btv = self.project(*self.hidden(tokens_bt, constrain, key, run_layers), constrain)
        return stack.natural(logits_btv, constrain)

    def hidden(self, tokens_bt: jax.Array, constrain: Hook = UNSHARDED,
               key: jax.Array | None = None, run_layers: RunLayers | None = None):
        """tokens [B, T] int32 -> (h [B, T, D] after the final LayerNorm, the tied table
        [V, D]), both in the compute dtype: what `project` turns into logits, so the loss
        can project a few positions at a time (meshtrain/step/loss.py)."""
        cfg = self.cfg
        keys = (None, None) if key is None else tuple(jax.random.split(key))
        x_btd = self.embed_tokens(tokens_bt, constrain, keys[0])
        x_btd = stack.run_layers(self.blocks, x_btd, constrain, keys[1], run_layers,
                                 num_layers=cfg.num_layers, remat_policy=cfg.remat, scan=cfg.scan_layers)
        return self.head(x_btd, constrain)

    def embed_tokens(self, tokens_bt: jax.Array, constrain: Hook = UNSHARDED,
                     key: jax.Array | None = None) -> jax.Array:
        """tokens [B, T] int32 -> x [B, T, D]: what the first layer takes, its rows in the
        layout's storage order (stack.stored), each with its position's embedding."""
        return self._embed(self._table(constrain), stack.stored(tokens_bt, constrain), None, constrain, key)

    def head(self, x_btd: jax.Array, constrain: Hook = UNSHARDED):
        """x [B, T, D] out of the last layer -> (h [B, T, D], the tied table [V, D]), as `hidden`."""
        return self.ln_f(x_btd), self._table(constrain)

    def project(self, h_btd: jax.Array, wte_vd: jax.Array, constrain: Hook = UNSHARDED) -> jax.Array:
        """h [B, t, D], table [V, D] -> logits [B, t, V], the padding columns masked."""
        logits_btv = jnp.einsum("btd,vd->btv", h_btd, wte_vd)
        return constrain(stack.mask_padding(logits_btv, self.cfg.vocab_size), ("batch", "length", "vocab"))

    def init_cache(self, batch: int, max_len: int) -> Cache:
        """Zeros (k, v), each [L, B, max_len, H, E] in the compute dtype."""
        c = self.cfg
        shape = (c.num_layers, batch, max_len, c.num_heads, c.head_dim)
        return jnp.zeros(shape, c.dtype), jnp.zeros(shape, c.dtype)

    def cache_axes(self):
        """Logical axes of the cache's leaves, as attention pins k and v."""
        axes = ("layers", "batch", "length", "heads", "head_dim")
        return axes, axes

    def decode(self, tokens_bt: jax.Array, cache: Cache, pos: jax.Array,
               constrain: Hook = UNSHARDED) -> tuple[jax.Array, Cache]:
        """tokens [B, t] at positions pos..pos+t-1 -> (logits [B, t, V], cache with them written)."""
        wte_vd = self._table(constrain)
        x_btd = self._embed(wte_vd, tokens_bt, pos, constrain, None)
        x_btd, cache = stack.decode_layers(self.blocks, x_btd, constrain, cache, pos)
        return self.project(self.ln_f(x_btd), wte_vd, constrain), cache

    def _table(self, constrain) -> jax.Array:
        """The table as compute wants it, [V, D] in the compute dtype (gathered over FSDP,
        split over vocab under TP). One value serves the lookup and the tied output
        projection, so their gradients meet before the data-parallel reduction, which
        then sends the table's gradient once, in the compute dtype."""
        return constrain(self.wte[...].astype(self.cfg.dtype), ("vocab", "embed"))

    def _embed(self, wte_vd, tokens_bt, pos, constrain, key) -> jax.Array:
        """pos None: a whole sequence in the layout's order (each row's documents' positions
        when the window is packed so); else positions pos..pos+t-1."""
        t = tokens_bt.shape[1]
        order = None if pos is not None else constrain.order(t)
        if pos is None and constrain.documents is not None:
            wpe_td = jnp.take(self.wpe[...], constrain.documents.positions, axis=0)  # [B, T, D]
        elif order is None:
            wpe_td = jax.lax.dynamic_slice_in_dim(self.wpe[...], 0 if pos is None else pos, t, axis=0)
        else:
            wpe_td = jnp.take(self.wpe[...], order, axis=0)
        wpe_td = wpe_td.astype(wte_vd.dtype)
        x_btd = jnp.take(wte_vd, tokens_bt, axis=0) + wpe_td
        x_btd = _dropout(x_btd, self.cfg.dropout, key)
        return constrain(x_btd, ("batch", "length", "embed"))


def activations(cfg: GPT2Config, b: int):
    """(what, shape, logical axes) of every activation the forward pass constrains."""
    t, d, h, e, f, v = cfg.seq_len, cfg.embed_dim, cfg.num_heads, cfg.head_dim, cfg.mlp_dim, cfg.padded_vocab_size
    return [("residual x", (b, t, d), ("batch", "length", "embed")),
            ("q, k, v, attention out", (b, t, h, e), ("batch", "length", "heads", "head_dim")),
            ("mlp hidden", (b, t, f), ("batch", "length", "mlp")),
            ("logits", (b, t, v), ("batch", "length", "vocab"))]


def layer_activation_bytes(cfg: GPT2Config, tokens: int, tensor: int, remat: str, sp: int = 1,
                           context: int = 1) -> float:
    """Bytes one block keeps for its backward pass (per-token elements, compute dtype):
    none       2 LayerNorm inputs (2 D, the stream), attention and MLP inputs whole (2 D); q, k, v and the
               attention output (4 D), the MLP hidden before and after GELU (2 F) and the
               softmax probabilities (H T, XLA attention only) split over tensor
    save_dots  the block input, attention and MLP projections' outputs (3 D, the stream; 3 D + F split)
    full       the block input (D, the stream)
    sp         the ranks the stream is split over by position (sequence parallelism)
    context    the ways attention's positions are split (context parallelism): see
               family.context_elements"""
    d, f = cfg.embed_dim, cfg.mlp_dim
    stream, whole, split, scores = {"full": (d, 0, 0, 0), "save_dots": (3 * d, 0, 3 * d + f, 0)}.get(
        remat, (2 * d, 2 * d, 4 * d + 2 * f, cfg.num_heads * cfg.seq_len))
    if cfg.attention != "xla":  # flash kernels keep a row statistic, not the [T, T] probabilities
        scores = 0
    if context > 1 and remat == "none":  # positions split: context attention's own score blocks
        # (no flash kernel) and the other devices' k, v (family.context_elements)
        scores, gathered = family.context_elements(cfg.context_attention, cfg.num_heads, cfg.head_dim, cfg.seq_len, context)
        split += gathered
    return family.korthikanti_bytes(tokens, jnp.dtype(cfg.dtype).itemsize, stream=stream, whole=whole,
                                     split=split, scores=scores, tensor=tensor, sp=sp)


def weight_input_bytes(cfg: GPT2Config, tokens: int, tensor: int) -> float:
    """Bytes one block's weight gradients read (per-token elements, compute dtype): the
    inputs of the four matrices, the two LayerNorms' outputs whole (2 D), the attention
    output and the MLP hidden after GELU split (D + F), and the cotangents of their
    outputs, the two projections' on the stream (2 D), q, k, v's and the MLP hidden's
    before GELU split (3 D + F): 8 D + 2 F. The biases' and the norms' gradients need no
    matmul and are made in B (parallel/pipeline/split_backward.py)."""
    d, f = cfg.embed_dim, cfg.mlp_dim
    return family.korthikanti_bytes(tokens, jnp.dtype(cfg.dtype).itemsize, stream=2 * d, whole=2 * d,
                                     split=4 * d + 2 * f, scores=0, tensor=tensor)


def tagged_elements(cfg: GPT2Config) -> dict[str, tuple[float, float]]:
    """Per token, each tagged activation's elements (whole, split over tensor): the qkv
    projection [3, H, E] and the MLP's first matmul [F] split by heads and mlp, the two
    output projections [D] whole (each rank's partial sum)."""
    d, f = cfg.embed_dim, cfg.mlp_dim
    return {"qkv": (0, 3 * d), "attn_out": (d, 0), "mlp_up": (0, f), "mlp_down": (d, 0)}


def flops_per_token(cfg: GPT2Config) -> float:
    """Training FLOPs per token, llm.c accounting: 6 N + 6 L D T."""
    return 6.0 * num_params(cfg) + 6.0 * cfg.num_layers * cfg.embed_dim * cfg.seq_len


def _check(cfg: GPT2Config) -> None:
    if cfg.embed_dim % cfg.num_heads:
        raise UserError(
            f"model.embed_dim={cfg.embed_dim} is not divisible by model.num_heads={cfg.num_heads}; "
            f"the head width would be fractional. Pick num_heads dividing {cfg.embed_dim}.")


FAMILY = family.register(family.Family(
    name="gpt2", config=GPT2Config, module=GPT2, sizes=sizes.GPT2_SIZES,
    activations=activations, layer_activation_bytes=layer_activation_bytes,
    weight_input_bytes=weight_input_bytes, num_params=num_params,
    flops_per_token=flops_per_token, tagged_elements=tagged_elements,
    size_keys={"length": "model.seq_len", "embed": "model.embed_dim", "heads": "model.num_heads",
               "head_dim": "model.embed_dim / model.num_heads", "mlp": "model.mlp_dim"},
    describe=lambda c: (f"gpt2: {c.num_layers} layers, {c.num_heads} heads, embed {c.embed_dim}, "
                        f"mlp {c.mlp_dim}, vocab {c.padded_vocab_size}, seq_len {c.seq_len}, "
                        f"params {c.param_dtype}"),
    check=_check,
))
