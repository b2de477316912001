"""Mixtral in Flax NNX (Jiang et al. 2024): Llama whose MLP is a mixture of experts.

Attention, RMSNorm, RoPE, the embedding and the output head are Llama's
(models/llama.py), so Hugging Face's MixtralForCausalLM loads with Llama's names and
transposes. Each block's MLP is models/moe.MoE: a router over `num_experts` SwiGLU
experts, `experts_per_token` of them per token, and optionally `num_shared_experts`
always-on ones (DeepSeekMoE's, not Mixtral's: such a model does not export).

Why Mixtral: its attention is Llama's, which meshtrain already proves equal to Hugging
Face's under every layout; its routing (softmax, top-k, renormalised) is the one Qwen-MoE
and DBRX share; and it is the most used open MoE with a transformers class to check
against. Shared experts cover DeepSeek-style models.

The router's statistics leave the layer scan in its carry: a block takes and returns
(x [B, T, D], stats [3] float32 summed over layers: load balance, z-loss, dropped share).
`hidden_aux` hands them, averaged over layers and weighted by moe.*_coef, to the loss.

Shapes: B batch, T length, D embed, H heads, K kv_heads, E head_dim, F expert mlp,
X experts, k experts per token, V vocab (padded), L layers.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from meshtrain.errors import UserError
from meshtrain.models import family, llama, moe, moe_dropless, sizes, stack
from meshtrain.models.attention import Cache
from meshtrain.models.hook import UNSHARDED, Hook
from meshtrain.models.stack import RunLayers


@dataclasses.dataclass(frozen=True, kw_only=True)
class MixtralConfig(llama.LlamaConfig):
    num_experts: int
    experts_per_token: int
    num_shared_experts: int = 0
    moe: moe.MoERun = moe.MoERun()  # how it is run (moe.* keys), not its weights

    RUN_FIELDS = ("moe",)  # family.ModelConfig.RUN_FIELDS

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.moe, dict):
            object.__setattr__(self, "moe", moe.MoERun(**self.moe))


def active_params(cfg: MixtralConfig, vocab_size: int | None = None) -> int:
    """Parameters a token passes through: the routed k experts of each block, not all X."""
    return _count(cfg, cfg.experts_per_token, vocab_size)


def num_params(cfg: MixtralConfig, vocab_size: int | None = None) -> int:
    """Closed form: Llama's with each block's 3 D F replaced by X 3 D F (the experts), D X
    (the router) and S 3 D F (shared experts)."""
    return _count(cfg, cfg.num_experts, vocab_size)


def _count(cfg: MixtralConfig, experts: int, vocab_size: int | None) -> int:
    d, f = cfg.embed_dim, cfg.mlp_dim
    per_layer = d * cfg.num_experts + 3 * d * f * (experts + cfg.num_shared_experts - 1)
    return llama.num_params(cfg, vocab_size) + cfg.num_layers * per_layer


class Block(nnx.Module):
    """Llama's pre-norm block with the experts for its MLP; stacked like it."""

    def __init__(self, cfg: MixtralConfig, rngs: nnx.Rngs, stack: int | None = None):
        self.attn_norm = llama.RMSNorm(cfg, stack)
        self.attn = llama.Attention(cfg, rngs, stack)
        self.mlp_norm = llama.RMSNorm(cfg, stack)
        self.moe = moe.MoE(embed=cfg.embed_dim, mlp=cfg.mlp_dim, num_experts=cfg.num_experts,
                           k=cfg.experts_per_token, shared=cfg.num_shared_experts, num_layers=cfg.num_layers,
                           run=cfg.moe, param_dtype=cfg.param_dtype, rngs=rngs, stack=stack)
        self.dropout = cfg.dropout

    def __call__(self, carry, constrain: Hook, key: jax.Array | None, cache: Cache | None = None,
                 pos: jax.Array | None = None):
        """(x [B, T, D], stats [3]) -> the same, stats plus this layer's; decoding (a KV
        cache): x -> (x, cache), the router's statistics dropped."""
        x_btd, stats = (carry, None) if cache is not None else carry
        own = []

        def mlp(h_btd, constrain):
            y_btd, s = self.moe(h_btd, constrain)
            own.append(s)  # traced in this same call: read back below
            return y_btd

        out = stack.pre_norm_block(x_btd, constrain, key, norm1=self.attn_norm, attn=self.attn,
                                   norm2=self.mlp_norm, mlp=mlp, rate=self.dropout, cache=cache, pos=pos)
        return out if cache is not None else (out, stats + own[0])


class Mixtral(llama.Llama):
    block = Block

    def hidden_aux(self, tokens_bt: jax.Array, constrain: Hook = UNSHARDED,
                   key: jax.Array | None = None, run_layers: RunLayers | None = None):
        """As `hidden`, plus the router's auxiliary loss [] (weighted by moe.*_coef) and
        its statistics {moe_load_balance, moe_z_loss, moe_dropped: [] means over layers,
        moe_aux_loss: [] the loss added, which a train row's loss includes}."""
        cfg = self.cfg
        keys = (None, None) if key is None else tuple(jax.random.split(key))
        x_btd = self.embed_tokens(tokens_bt, constrain, keys[0])
        carry = (x_btd, jnp.zeros(len(moe.STATS), jnp.float32))
        x_btd, stats = stack.run_layers(self.blocks, carry, constrain, keys[1], run_layers,
                                        num_layers=cfg.num_layers, remat_policy=cfg.remat, scan=cfg.scan_layers)
        stats = stats / cfg.num_layers
        aux = cfg.moe.aux_loss_coef * stats[0] + cfg.moe.z_loss_coef * stats[1]
        metrics = {f"moe_{n}": s for n, s in zip(moe.STATS, stats)}
        return (*self.head(x_btd, constrain), aux, {**metrics, "moe_aux_loss": aux})

    def hidden(self, tokens_bt, constrain=UNSHARDED, key=None, run_layers=None):
        h_btd, w, _, _ = self.hidden_aux(tokens_bt, constrain, key, run_layers)
        return h_btd, w


def activations(cfg: MixtralConfig, b: int):
    """(what, shape, logical axes) of every activation the forward pass constrains: Llama's
    but its MLP's hidden, the shared experts' hidden, and the capacity dispatch's buffers."""
    t, d, x, k = cfg.seq_len, cfg.embed_dim, cfg.num_experts, cfg.experts_per_token
    dense = [a for a in llama.activations(cfg, b) if a[0] != "mlp hidden"]
    if cfg.num_shared_experts:
        dense.append(("shared experts' hidden", (b, t, cfg.num_shared_experts * cfg.mlp_dim),
                      ("batch", "length", "mlp")))
    if cfg.moe.dispatch != "capacity":
        return dense
    c = moe.capacity(t, x, k, cfg.moe.capacity_factor)
    return dense + [("expert buffers", (x, b, c, d), ("experts", "batch", None, "embed")),
                    ("expert hidden", (x, b, c, cfg.mlp_dim), ("experts", "batch", None, "mlp"))]


def layer_activation_bytes(cfg: MixtralConfig, tokens: int, tensor: int, remat: str, sp: int = 1,
                           context: int = 1, expert: int = 1) -> float:
    """Bytes one block keeps for its backward pass: Llama's (models/llama.py) with the
    dense MLP's SwiGLU at the shared experts' width, plus the MoE layer's. Per token, with
    k experts a token, X experts, C slots per sequence, F the expert mlp, e = `expert`
    (the devices `experts` is split over, dropless's exchange) and remat none:
      router     logits and probabilities, 2 X float32
      dropless   the copies the windows read ([e n k, D]: e k D), the windows' matmul
                 outputs, gate and up [W e n k, F/t] and down [W e n k, D] with W = 1 +
                 1 / moe_dropless.WINDOWS_PER_GROUP (W e k (2 F/t + D); the rest of the
                 SwiGLU is recomputed), the copies' outputs for the weighted sum (k D);
                 W = 1 with moe.grouped_matmul=ragged_dot, which keeps its products' outputs
                 over the rows alone (models/moe_ragged.py)
      capacity   the dispatch and combine one-hots [B, T, X, C] (2 X C / 1), the per-choice
                 slots [B, T, k, X, C] in float32 (the combine's weights' gradient), the
                 buffers in and out [X, B, C, D] (2 X C D / T) and the SwiGLU's four
                 [X, B, C, F/t] (4 X C F / T, split)
    save_dots and full keep none of it: the policy saves no batched (capacity's expert
    dim) or windowed (dropless's grouped) matmul, and the layer is rerun."""
    dense = dataclasses.replace(cfg, mlp_dim=cfg.num_shared_experts * cfg.mlp_dim)
    kept = llama.layer_activation_bytes(dense, tokens, tensor, remat, sp=sp, context=context)
    if remat != "none":
        return kept
    c, t, x, k, d, f = (jnp.dtype(cfg.dtype).itemsize, cfg.seq_len, cfg.num_experts, cfg.experts_per_token,
                        cfg.embed_dim, cfg.mlp_dim)
    own = 2 * x * 4
    if cfg.moe.dispatch == "capacity":
        slots = moe.capacity(t, x, k, cfg.moe.capacity_factor)
        own += c * (2 * x * slots + 2 * x * slots * d / t + 4 * x * slots * f / t / tensor) + 4 * k * x * slots
    else:
        windowed = moe_dropless.grouped_matmul(cfg.moe.grouped_matmul) == "windowed"
        win = 1 + 1 / moe_dropless.WINDOWS_PER_GROUP if windowed else 1
        own += c * (expert * k * d + win * expert * k * (2 * f / tensor + d) + k * d)
    return kept + tokens * own


def flops_per_token(cfg: MixtralConfig) -> float:
    """Training FLOPs per token on the active parameters: 6 N_active + 6 L D T (Llama's
    accounting, the untied input table a lookup). Capacity dispatch's one-hot einsums and
    empty slots are overhead, not counted."""
    return 6.0 * (active_params(cfg) - cfg.vocab_size * cfg.embed_dim) + 6.0 * cfg.num_layers * cfg.embed_dim * cfg.seq_len


def _check(cfg: MixtralConfig) -> None:
    llama.FAMILY.check(cfg)
    if not 1 <= cfg.experts_per_token <= cfg.num_experts:
        raise UserError(f"model.experts_per_token={cfg.experts_per_token} with model.num_experts="
                        f"{cfg.num_experts}: each token picks between 1 and num_experts experts.")
    if cfg.num_shared_experts < 0:
        raise UserError(f"model.num_shared_experts={cfg.num_shared_experts}: must be >= 0.")
    cfg.moe.check()


def _describe(c: MixtralConfig) -> str:
    shared = f" + {c.num_shared_experts} shared" if c.num_shared_experts else ""
    run = c.moe.dispatch + (f" x{c.moe.capacity_factor:g}" if c.moe.dispatch == "capacity" else
                            f", {moe_dropless.grouped_matmul(c.moe.grouped_matmul)}")
    return (f"mixtral: {c.num_layers} layers, {c.num_heads} heads ({c.num_kv_heads} kv), embed {c.embed_dim}, "
            f"{c.num_experts} experts{shared} of mlp {c.mlp_dim}, top-{c.experts_per_token} ({run}), vocab "
            f"{c.padded_vocab_size}, seq_len {c.seq_len}, rope theta {c.rope_theta:g}, params {c.param_dtype}; "
            f"{active_params(c) / 1e6:,.1f}M of {num_params(c) / 1e6:,.1f}M parameters active")


def tagged_elements(cfg: MixtralConfig) -> dict[str, tuple[float, float]]:
    """The attention's tags, Llama's (the experts tag nothing: offload:mlp_up keeps none)."""
    return {tag: n for tag, n in llama.tagged_elements(cfg).items() if tag in ("qkv", "attn_out")}


FAMILY = family.register(family.Family(
    name="mixtral", config=MixtralConfig, module=Mixtral, sizes=sizes.MIXTRAL_SIZES,
    activations=activations, num_params=num_params, active_params=active_params,
    flops_per_token=flops_per_token, pipelines=False, layer_activation_bytes=layer_activation_bytes,
    tagged_elements=tagged_elements,
    size_keys={**llama.FAMILY.size_keys, "experts": "model.num_experts"},
    describe=_describe, check=_check, metrics=(*(f"moe_{n}" for n in moe.STATS), "moe_aux_loss"),
))
