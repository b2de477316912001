"""Mixtral <-> Hugging Face `MixtralForCausalLM` (model_type "mixtral").

Attention, norms, embeddings and the output head are Llama's names and transposes
(hf/llama.py's table); each block's MLP is a router and X experts (D embed, F expert
mlp, X experts, i a layer, x an expert):

  model.layers.i.block_sparse_moe.gate.weight           [X, D]   blocks/moe/router [L, D, X]
  model.layers.i.block_sparse_moe.experts.x.w1.weight   [F, D]   blocks/moe/w_gate [L, X, D, F]
  model.layers.i.block_sparse_moe.experts.x.w3.weight   [F, D]   blocks/moe/w_up [L, X, D, F]
  model.layers.i.block_sparse_moe.experts.x.w2.weight   [D, F]   blocks/moe/w_down [L, X, F, D]

These are the names of Mistral's release, and what transformers 5 writes with
save_pretrained (it fuses the experts in memory and unfuses them on saving). A file
saved with save_original_format=False holds transformers 5's in-memory names, which are
read too (import only):

  model.layers.i.mlp.gate.weight                        [X, D]      the router
  model.layers.i.mlp.experts.gate_up_proj               [X, 2F, D]  w_gate (first F rows), w_up
  model.layers.i.mlp.experts.down_proj                  [X, D, F]   w_down

Shared experts (model.num_shared_experts > 0) are meshtrain's, not Mixtral's: such a
model has no Hugging Face form and its export is refused.
"""

from __future__ import annotations

from meshtrain.errors import UserError
from meshtrain.hf import llama
from meshtrain.hf.tensors import Tensor

FAMILY = "mixtral"
MODEL_TYPE = "mixtral"
ARCHITECTURE = "MixtralForCausalLM"
SUPPORTED = ("meshtrain's mixtral is Hugging Face's MixtralForCausalLM with silu experts, "
             "head_dim = hidden_size / num_attention_heads, plain RoPE (or Llama 3.1's), and "
             "no sliding window shorter than max_position_embeddings.")
# MixtralConfig's defaults where they differ from those hf/llama.py assumes for a key a
# config.json leaves out (transformers 5, configuration_mixtral.py).
DEFAULTS = {"rope_theta": 1_000_000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096 * 32,
            "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2}
FUSED = "mlp.experts.gate_up_proj"


def architecture(config: dict, where: str) -> dict:
    """config.json -> the meshtrain mixtral fields that fix its shapes; a UserError for
    settings meshtrain's Mixtral does not implement."""
    config = {**DEFAULTS, **config}
    arch = llama.architecture(config, where, FAMILY, SUPPORTED)
    window = config.get("sliding_window")
    if window is not None and int(window) < arch["max_position_embeddings"]:
        raise UserError(f"{where}: sliding_window={window} is shorter than max_position_embeddings="
                        f"{arch['max_position_embeddings']}, and meshtrain's mixtral attends to the whole "
                        f"context. {SUPPORTED}")
    experts, k = int(config["num_local_experts"]), int(config["num_experts_per_tok"])
    if not 1 <= k <= experts:
        raise UserError(f"{where}: num_experts_per_tok={k} with num_local_experts={experts}: each "
                        f"token picks between 1 and num_local_experts experts. Re-save the model.")
    return dict(arch, num_experts=experts, experts_per_token=k, num_shared_experts=0)


def prefix(names) -> str:
    return "model."


def table(arch: dict, p: str = "model.", fused: bool = False) -> list[Tensor]:
    """The tensors of a Mixtral: Llama's without its dense MLP, and the experts, one
    tensor per expert (`fused`: transformers 5's in-memory names, for import only)."""
    if arch.get("num_shared_experts"):
        raise UserError(f"This mixtral has model.num_shared_experts={arch['num_shared_experts']}: "
                        f"shared experts are meshtrain's (DeepSeekMoE's), and Hugging Face's "
                        f"MixtralForCausalLM has no place for them, so it cannot be exported. "
                        f"Keep it as a meshtrain checkpoint, or train with num_shared_experts=0.")
    dense = [t for t in llama.table(arch, p) if not t.ours.startswith("blocks/mlp/")]
    layer, x, f = p + "layers.{i}.", arch["num_experts"], arch["mlp_dim"]
    t = (lambda a: a.T, lambda a: a.T)
    if fused:
        experts = layer + "mlp.experts."
        swap = lambda a: a.transpose(0, 2, 1)  # noqa: E731  [X, out, in] <-> [X, in, out]
        moe = [Tensor("blocks/moe/router", layer + "mlp.gate.weight", *t),
               Tensor("blocks/moe/w_gate", experts + "gate_up_proj", lambda a: swap(a[:, :f])),
               Tensor("blocks/moe/w_up", experts + "gate_up_proj", lambda a: swap(a[:, f:])),
               Tensor("blocks/moe/w_down", experts + "down_proj", swap, swap)]
    else:
        expert = layer + "block_sparse_moe.experts.{x}."
        moe = [Tensor("blocks/moe/router", layer + "block_sparse_moe.gate.weight", *t),
               Tensor("blocks/moe/w_gate", expert + "w1.weight", *t, experts=x),
               Tensor("blocks/moe/w_up", expert + "w3.weight", *t, experts=x),
               Tensor("blocks/moe/w_down", expert + "w2.weight", *t, experts=x)]
    return dense + moe


def import_table(arch: dict, names) -> list[Tensor]:
    """The table for a file holding `names`: experts one by one, or fused."""
    return table(arch, prefix(names), fused=any(n.endswith(FUSED) for n in names))


ignored_for = llama.ignored_for


def hf_config(arch: dict, base: dict | None, dtype: str, special: dict) -> dict:
    """config.json for MixtralForCausalLM: Llama's fields with the experts'; `base` (the
    config converted from, if any) keeps its own router settings (router_aux_loss_coef,
    router_jitter_noise) and sliding_window."""
    config = llama.hf_config(arch, base, dtype, special)
    for key in ("attention_bias", "mlp_bias"):  # Llama's switches; Mixtral has neither
        config.pop(key)
    config.update(architectures=[ARCHITECTURE], model_type=MODEL_TYPE, num_local_experts=arch["num_experts"],
                  num_experts_per_tok=arch["experts_per_token"])
    config.setdefault("sliding_window", None)
    return config
