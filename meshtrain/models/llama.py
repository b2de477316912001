"""Llama in Flax NNX, written with logical axis names only (Touvron et al. 2023; Llama 3).

RMSNorm, rotary position embeddings, SwiGLU MLP, grouped-query attention, no biases,
tied or untied output embedding. The layout of every weight matches Hugging Face's
LlamaForCausalLM up to a transpose and a reshape (e.g. q_proj.weight [H*E, D] is
wq [D, H, E] reshaped and transposed), and RoPE uses Hugging Face's "rotate_half"
convention (the two halves of a head, not interleaved pairs), so a Hugging Face
checkpoint loads without permuting rows.

Like models/gpt2.py: parameters carry logical axes, activations are pinned through
`constrain`, blocks are stored stacked and run by `stack.run_layers`.

Grouped-query attention under tensor parallelism (docs/layouts.md): K and V have K
heads, which the presets never split (K may be smaller than the tensor axis). Each
tensor rank projects all K heads, and attention.attend repeats them to the H query heads,
so attention splits over `heads` exactly like multi-head attention (with the positions
split over devices, the K heads travel and are repeated on arrival).

Shapes: B batch, T length, D embed, H heads, K kv_heads, E head_dim, F mlp,
V vocab (padded), L layers, S cache length.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from meshtrain.errors import UserError
from meshtrain.models import family, sizes, stack
from meshtrain.models.attention import Cache, attend
from meshtrain.models.hook import UNSHARDED, Hook
from meshtrain.models.rope import RopeScaling, inverse_frequencies, rope
from meshtrain.models.stack import RunLayers, dropout as _dropout, param

BTHE = ("batch", "length", "heads", "head_dim")
BTKE = ("batch", "length", "kv_heads", "head_dim")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig(family.ModelConfig):
    num_heads: int
    num_kv_heads: int
    embed_dim: int
    mlp_dim: int
    rope_theta: float = 10_000.0
    rope_scaling: RopeScaling | None = None
    # The context the model supports at inference (Hugging Face's max_position_embeddings,
    # e.g. 131072 for Llama 3.1 8B, trained at seq_len 8192 and scaled); None: seq_len.
    max_position_embeddings: int | None = None
    tie_embeddings: bool = False
    norm_eps: float = 1e-5

    def __post_init__(self):
        # The size table (and a config read back from JSON) give the scaling as a dict
        # in Hugging Face's key names; the config keeps a hashable dataclass.
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        object.__setattr__(self, "rope_theta", float(self.rope_theta))

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    def max_context(self) -> tuple[int, str]:
        """RoPE computes each position's rotation, so decoding may go past seq_len up to
        max_position_embeddings (the context the model supports), never further."""
        most, trained = self.max_position_embeddings, self.seq_len
        if most is None:
            return trained, (f"this llama was trained at model.seq_len={trained} and records no "
                             f"longer context it supports (max_position_embeddings, which a model "
                             f"converted from Hugging Face carries)")
        if trained > most:
            return trained, (f"this llama was trained at model.seq_len={trained}, past the "
                             f"max_position_embeddings={most} it started from")
        scaled = "" if self.rope_scaling is None else (
            f", its RoPE stretched from {self.rope_scaling.original_max_position_embeddings} "
            f"positions by Llama 3.1's frequency scaling")
        return most, f"this llama supports max_position_embeddings={most} positions{scaled}"


def num_params(cfg: LlamaConfig, vocab_size: int | None = None) -> int:
    """Closed form: L (2 D + 2 D H E + 2 D K E + 3 D F) + V D (+ D V untied) + D."""
    d, e, v = cfg.embed_dim, cfg.head_dim, cfg.vocab_size if vocab_size is None else vocab_size
    per_layer = 2 * d + 2 * d * cfg.num_heads * e + 2 * d * cfg.num_kv_heads * e + 3 * d * cfg.mlp_dim
    return cfg.num_layers * per_layer + v * d * (1 if cfg.tie_embeddings else 2) + d


class RMSNorm(nnx.Module):
    def __init__(self, cfg: LlamaConfig, stack: int | None = None):
        self.scale = param(None, (cfg.embed_dim,), ("embed",), stack, jnp.dtype(cfg.param_dtype), "ones")
        self.eps = cfg.norm_eps

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        # Statistics in float32; the scale multiplies in the compute dtype, as Meta's
        # and Hugging Face's references do.
        x = x_btd.astype(jnp.float32)
        y = (x * jax.lax.rsqrt(jnp.square(x).mean(-1, keepdims=True) + self.eps)).astype(x_btd.dtype)
        return y * self.scale[...].astype(x_btd.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs, stack: int | None = None):
        d, h, k, e = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        dt = jnp.dtype(cfg.param_dtype)
        self.wq = param(rngs, (d, h, e), ("embed", "heads", "head_dim"), stack, dt, "normal")
        self.wk = param(rngs, (d, k, e), ("embed", "kv_heads", "head_dim"), stack, dt, "normal")
        self.wv = param(rngs, (d, k, e), ("embed", "kv_heads", "head_dim"), stack, dt, "normal")
        # Residual projections scaled by 1/sqrt(2L), as in GPT-2.
        std_out = 0.02 / math.sqrt(2 * cfg.num_layers)
        self.wo = param(rngs, (h, e, d), ("heads", "head_dim", "embed"), stack, dt, "normal", std_out)
        self.cfg = cfg

    def __call__(self, x_btd: jax.Array, constrain: Hook, cache: Cache | None = None,
                 pos: jax.Array | None = None):
        """x [B, T, D] at positions pos..pos+T-1 (0.. without a cache) -> y [B, T, D];
        with a K-head cache (k, v [B, S, K, E], see attention.attend) -> (y, cache)."""
        cfg, dt = self.cfg, x_btd.dtype
        positions_t = stack.positions(constrain, x_btd.shape[1], pos)
        inv_freq = inverse_frequencies(cfg)
        q = checkpoint_name(jnp.einsum("btd,dhe->bthe", x_btd, self.wq[...].astype(dt)), "qkv")
        k = checkpoint_name(jnp.einsum("btd,dke->btke", x_btd, self.wk[...].astype(dt)), "qkv")
        v = checkpoint_name(jnp.einsum("btd,dke->btke", x_btd, self.wv[...].astype(dt)), "qkv")
        q = constrain(rope(q, positions_t, inv_freq), BTHE)
        k = rope(k, positions_t, inv_freq)
        if cache is None:
            # All K heads on every tensor rank (kv_heads unsplit; see the module docstring),
            # and their positions as attention sees them: under sequence parallelism
            # `length:tensor` would claim the tensor axis K heads leave free and split k
            # and v by position, only for them to be gathered again for the heads split.
            # attend repeats them to the query heads (or, positions split, sends the K heads).
            k, v = (constrain.as_attention_sees(a, BTKE) for a in (k, v))
        else:
            # The cache keeps the K heads: H/K times smaller than a multi-head cache.
            k, v = constrain(k, BTKE), constrain(v, BTKE)
        o_bthe, cache = attend(q, k, v, cache, pos, implementation=self.cfg.attention,
                               constrain=constrain, context=self.cfg.context_attention)
        o_bthe = constrain(o_bthe, BTHE)
        y = checkpoint_name(jnp.einsum("bthe,hed->btd", o_bthe, self.wo[...].astype(dt)), "attn_out")
        if cache is None:
            return y
        return y, tuple(constrain(c, BTKE) for c in cache)


class MLP(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs, stack: int | None = None):
        d, f = cfg.embed_dim, cfg.mlp_dim
        dt = jnp.dtype(cfg.param_dtype)
        self.w_gate = param(rngs, (d, f), ("embed", "mlp"), stack, dt, "normal")
        self.w_up = param(rngs, (d, f), ("embed", "mlp"), stack, dt, "normal")
        std_out = 0.02 / math.sqrt(2 * cfg.num_layers)
        self.w_down = param(rngs, (f, d), ("mlp", "embed"), stack, dt, "normal", std_out)

    def __call__(self, x_btd: jax.Array, constrain: Hook) -> jax.Array:
        """SwiGLU: (silu(x W_gate) * (x W_up)) W_down. Gate and up are one matmul against the
        two stacked [D, 2, F], so the backward sums their input gradients before tensor
        parallelism's all-reduce: one all-reduce of [B, T, D], not two."""
        dt = x_btd.dtype
        w_d2f = jnp.stack([self.w_gate[...], self.w_up[...]], axis=1).astype(dt)
        gate_up_bt2f = checkpoint_name(jnp.einsum("btd,dkf->btkf", x_btd, w_d2f), "mlp_up")
        h_btf = jax.nn.silu(gate_up_bt2f[:, :, 0]) * gate_up_bt2f[:, :, 1]
        h_btf = constrain(h_btf, ("batch", "length", "mlp"))
        return checkpoint_name(h_btf @ self.w_down[...].astype(dt), "mlp_down")


class Block(nnx.Module):
    """Pre-RMSNorm block; built with `stack=L` it holds L blocks' weights."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs, stack: int | None = None):
        self.attn_norm = RMSNorm(cfg, stack)
        self.attn = Attention(cfg, rngs, stack)
        self.mlp_norm = RMSNorm(cfg, stack)
        self.mlp = MLP(cfg, rngs, stack)
        self.dropout = cfg.dropout

    def __call__(self, x_btd: jax.Array, constrain: Hook, key: jax.Array | None,
                 cache: Cache | None = None, pos: jax.Array | None = None):
        """x [B, T, D] -> x; with a KV cache (decoding, no dropout) -> (x, cache)."""
        return stack.pre_norm_block(x_btd, constrain, key, norm1=self.attn_norm, attn=self.attn, norm2=self.mlp_norm,
                                    mlp=self.mlp, rate=self.dropout, cache=cache, pos=pos)


class Llama(nnx.Module):
    block = Block  # the stacked layer (models/mixtral.py swaps the MLP for experts)

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        dt = jnp.dtype(cfg.param_dtype)
        self.cfg = cfg
        v, padded, d = cfg.vocab_size, cfg.padded_vocab_size, cfg.embed_dim
        self.embed = stack.vocab_table(rngs, v, padded, d, dt, ("vocab", "embed"))
        self.blocks = self.block(cfg, rngs, stack=cfg.num_layers)
        self.final_norm = RMSNorm(cfg)
        if not cfg.tie_embeddings:  # padding columns zero, as the embedding's rows
            self.lm_head = stack.vocab_table(rngs, v, padded, d, dt, ("embed", "vocab"))

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
        """tokens [B, T] int32 -> (h [B, T, D] after the final norm, the output projection:
        the tied table [V, D] or the head [D, V]), both in the compute dtype: what `project`
        turns into logits, so the loss can project a few positions at a time
        (meshtrain/step/loss.py)."""
        cfg = self.cfg
        keys = (None, None) if key is None else tuple(jax.random.split(key))
        x_btd = self.embed_tokens(tokens_bt, constrain, keys[0])
        x_btd = stack.run_layers(self.blocks, x_btd, constrain, keys[1], run_layers,
                                 num_layers=cfg.num_layers, remat_policy=cfg.remat, scan=cfg.scan_layers)
        return self.head(x_btd, constrain)

    def embed_tokens(self, tokens_bt: jax.Array, constrain: Hook = UNSHARDED,
                     key: jax.Array | None = None) -> jax.Array:
        """tokens [B, T] int32 -> x [B, T, D]: what the first layer takes, its rows in the
        layout's storage order (stack.stored)."""
        return self._embed(self._table(constrain), stack.stored(tokens_bt, constrain), constrain, key)

    def head(self, x_btd: jax.Array, constrain: Hook = UNSHARDED):
        """x [B, T, D] out of the last layer -> (h [B, T, D], the output projection), as `hidden`."""
        embed_vd = self._table(constrain) if self.cfg.tie_embeddings else None
        return self.final_norm(x_btd), self._head(embed_vd, constrain)

    def project(self, h_btd: jax.Array, w: jax.Array, constrain: Hook = UNSHARDED) -> jax.Array:
        """h [B, t, D], w from `hidden` ([V, D] tied, [D, V] untied) -> logits [B, t, V],
        the padding columns masked."""
        spec = "btd,vd->btv" if self.cfg.tie_embeddings else "btd,dv->btv"
        logits_btv = jnp.einsum(spec, h_btd, w)
        return constrain(stack.mask_padding(logits_btv, self.cfg.vocab_size), ("batch", "length", "vocab"))

    def init_cache(self, batch: int, max_len: int) -> Cache:
        """Zeros (k, v), each [L, B, max_len, K, E] in the compute dtype (the K kv heads)."""
        c = self.cfg
        shape = (c.num_layers, batch, max_len, c.num_kv_heads, c.head_dim)
        return jnp.zeros(shape, c.dtype), jnp.zeros(shape, c.dtype)

    def cache_axes(self):
        """Logical axes of the cache's leaves, as attention pins k and v: the K heads."""
        axes = ("layers", *BTKE)
        return axes, axes

    def decode(self, tokens_bt: jax.Array, cache: Cache, pos: jax.Array,
               constrain: Hook = UNSHARDED) -> tuple[jax.Array, Cache]:
        """tokens [B, t] at positions pos..pos+t-1 -> (logits [B, t, V], cache with them written)."""
        embed_vd = self._table(constrain)
        x_btd = self._embed(embed_vd, tokens_bt, constrain, None)
        x_btd, cache = stack.decode_layers(self.blocks, x_btd, constrain, cache, pos)
        return self.project(self.final_norm(x_btd), self._head(embed_vd, constrain), constrain), cache

    def _table(self, constrain) -> jax.Array:
        """The input table [V, D] in the compute dtype, as compute wants it (gathered over
        FSDP, split over vocab under TP); tied, it is also the output projection, and the
        two gradients meet before the data-parallel reduction."""
        return constrain(self.embed[...].astype(self.cfg.dtype), ("vocab", "embed"))

    def _embed(self, embed_vd, tokens_bt, constrain, key) -> jax.Array:
        x_btd = jnp.take(embed_vd, tokens_bt, axis=0)
        x_btd = _dropout(x_btd, self.cfg.dropout, key)
        return constrain(x_btd, ("batch", "length", "embed"))

    def _head(self, embed_vd, constrain) -> jax.Array:
        """The output projection in the compute dtype: the table [V, D] when tied, else the
        head [D, V] as compute wants it (gathered over FSDP, split over vocab under TP)."""
        if self.cfg.tie_embeddings:
            return embed_vd
        return constrain(self.lm_head[...], ("embed", "vocab")).astype(self.cfg.dtype)


def activations(cfg: LlamaConfig, b: int):
    """(what, shape, logical axes) of every activation the forward pass constrains."""
    t, d, h, k, e = cfg.seq_len, cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    return [("residual x", (b, t, d), ("batch", "length", "embed")),
            ("k, v (kv heads)", (b, t, k, e), BTKE),
            ("q, k, v (repeated), attention out", (b, t, h, e), BTHE),
            ("mlp hidden", (b, t, cfg.mlp_dim), ("batch", "length", "mlp")),
            ("logits", (b, t, cfg.padded_vocab_size), ("batch", "length", "vocab"))]


def layer_activation_bytes(cfg: LlamaConfig, tokens: int, tensor: int, remat: str, sp: int = 1,
                           context: int = 1) -> float:
    """Bytes one block keeps for its backward pass (per-token elements, compute dtype):
    none       2 RMSNorm inputs (2 D, the stream), attention and MLP inputs whole (2 D); q, k and v repeated
               to H heads, the attention output (4 D), the SwiGLU gate, its SiLU, up and
               their product (4 F) and the softmax probabilities (H T, XLA attention only) split over tensor
    save_dots  the block input, the output and down projections (3 D, the stream), the K/V
               projections (2 K E whole: kv heads are not split), q and gate/up (D + 2 F split)
    full       the block input (D, the stream)
    sp         the ranks the stream is split over by position (sequence parallelism)
    context    the ways attention's positions are split (context parallelism): see
               family.context_elements"""
    d, f, kv = cfg.embed_dim, cfg.mlp_dim, cfg.num_kv_heads * cfg.head_dim
    stream, whole, split, scores = {"full": (d, 0, 0, 0), "save_dots": (3 * d, 2 * kv, d + 2 * f, 0)}.get(
        remat, (2 * d, 2 * d, 4 * d + 4 * f, cfg.num_heads * cfg.seq_len))
    if cfg.attention != "xla":  # flash kernels keep a row statistic, not the [T, T] probabilities
        scores = 0
    if context > 1 and remat == "none":  # positions split: context attention's own score blocks
        # (no flash kernel) and the other devices' k, v (family.context_elements)
        scores, gathered = family.context_elements(cfg.context_attention, cfg.num_heads, cfg.head_dim, cfg.seq_len, context)
        split += gathered
    return family.korthikanti_bytes(tokens, jnp.dtype(cfg.dtype).itemsize, stream=stream, whole=whole,
                                     split=split, scores=scores, tensor=tensor, sp=sp)


def weight_input_bytes(cfg: LlamaConfig, tokens: int, tensor: int) -> float:
    """Bytes one block's weight gradients read (per-token elements, compute dtype): the
    inputs of its seven matrices, the two RMSNorms' outputs whole (2 D; q, k and v share
    one, gate and up the other), the attention output and the SwiGLU product split
    (D + F), and the cotangents of their outputs, the two projections' on the stream
    (2 D), q's, gate's and up's split (D + 2 F), k's and v's at the kv heads, whole as
    save_dots keeps them (2 K E): 6 D + 3 F + 2 K E."""
    d, f, kv = cfg.embed_dim, cfg.mlp_dim, cfg.num_kv_heads * cfg.head_dim
    return family.korthikanti_bytes(tokens, jnp.dtype(cfg.dtype).itemsize, stream=2 * d, whole=2 * d + 2 * kv,
                                     split=2 * d + 3 * f, scores=0, tensor=tensor)


def flops_per_token(cfg: LlamaConfig) -> float:
    """Training FLOPs per token: 6 N_matmul + 6 L D T (llm.c's accounting for attention).

    N_matmul leaves out the input embedding when the output is untied: the table is a
    lookup, not a matmul (counting it would overstate MFU by ~6% at Llama 3 8B). A tied
    table is counted once, as the output projection.
    """
    lookup = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.embed_dim
    return 6.0 * (num_params(cfg) - lookup) + 6.0 * cfg.num_layers * cfg.embed_dim * cfg.seq_len


def _check(cfg: LlamaConfig) -> None:
    if cfg.embed_dim % cfg.num_heads:
        raise UserError(
            f"model.embed_dim={cfg.embed_dim} is not divisible by model.num_heads={cfg.num_heads}; "
            f"the head width would be fractional. Pick num_heads dividing {cfg.embed_dim}.")
    if cfg.num_heads % cfg.num_kv_heads:
        raise UserError(
            f"model.num_heads={cfg.num_heads} is not divisible by model.num_kv_heads="
            f"{cfg.num_kv_heads}; grouped-query attention gives each kv head an equal group of "
            f"query heads. Pick num_kv_heads dividing {cfg.num_heads}.")
    if cfg.head_dim % 2:
        raise UserError(
            f"head width model.embed_dim / model.num_heads = {cfg.head_dim} is odd; rotary "
            f"embeddings rotate pairs of dims. Pick dims with an even head width.")
    if not isinstance(cfg.tie_embeddings, bool):
        raise UserError(f"model.tie_embeddings={cfg.tie_embeddings!r}: must be True or False.")
    if cfg.max_position_embeddings is not None and cfg.max_position_embeddings < 1:
        raise UserError(f"max_position_embeddings={cfg.max_position_embeddings}: must be >= 1.")
    if not (cfg.rope_theta > 0 and cfg.norm_eps > 0):
        raise UserError(f"model.rope_theta={cfg.rope_theta}, norm_eps={cfg.norm_eps}: both must be > 0.")
    s = cfg.rope_scaling
    if s is not None and not (s.factor >= 1 and 0 < s.low_freq_factor < s.high_freq_factor
                              and s.original_max_position_embeddings >= 1):
        raise UserError(
            f"rope_scaling {s}: Llama 3 scaling needs factor >= 1, 0 < low_freq_factor < "
            f"high_freq_factor and original_max_position_embeddings >= 1.")


def _describe(c: LlamaConfig) -> str:
    scaling = "" if c.rope_scaling is None else f" (llama3 scaling x{c.rope_scaling.factor:g})"
    longest = c.max_context()[0]
    reach = f" (supports {longest})" if longest > c.seq_len else ""
    return (f"llama: {c.num_layers} layers, {c.num_heads} heads ({c.num_kv_heads} kv), embed "
            f"{c.embed_dim}, mlp {c.mlp_dim}, vocab {c.padded_vocab_size}, seq_len {c.seq_len}{reach}, "
            f"rope theta {c.rope_theta:g}{scaling}, {'tied' if c.tie_embeddings else 'untied'} "
            f"output, params {c.param_dtype}")


def tagged_elements(cfg: LlamaConfig) -> dict[str, tuple[float, float]]:
    """Per token, each tagged activation's elements (whole, split over tensor): q [H, E] and
    k, v [K, E], and SwiGLU's gate and up [2, F], split by heads and mlp; the two output
    projections [D] whole (each rank's partial sum)."""
    d, e = cfg.embed_dim, cfg.head_dim
    return {"qkv": (0, (cfg.num_heads + 2 * cfg.num_kv_heads) * e), "attn_out": (d, 0),
            "mlp_up": (0, 2 * cfg.mlp_dim), "mlp_down": (d, 0)}


FAMILY = family.register(family.Family(
    name="llama", config=LlamaConfig, module=Llama, sizes=sizes.LLAMA_SIZES,
    activations=activations, layer_activation_bytes=layer_activation_bytes,
    weight_input_bytes=weight_input_bytes, num_params=num_params,
    flops_per_token=flops_per_token, tagged_elements=tagged_elements,
    size_keys={"length": "model.seq_len", "embed": "model.embed_dim", "heads": "model.num_heads",
               "kv_heads": "model.num_kv_heads", "head_dim": "model.embed_dim / model.num_heads",
               "mlp": "model.mlp_dim"},
    describe=_describe, check=_check,
))
