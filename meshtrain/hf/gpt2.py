"""GPT-2 <-> Hugging Face `GPT2LMHeadModel` (model_type "gpt2").

Hugging Face stores GPT-2's projections as Conv1D weights [in, out], so every weight
maps by a reshape alone (D embed, H heads, E head width, F mlp, i a layer):

  transformer.wte.weight              [V, D]   wte [V, D]
  transformer.wpe.weight              [T, D]   wpe [T, D]
  transformer.h.i.ln_1.{weight,bias}  [D]      blocks/ln1/{scale,bias} [L, D]
  transformer.h.i.attn.c_attn.weight  [D, 3D]  blocks/attn/w_qkv [L, D, 3, H, E]
  transformer.h.i.attn.c_attn.bias    [3D]     blocks/attn/b_qkv [L, 3, H, E]
  transformer.h.i.attn.c_proj.weight  [D, D]   blocks/attn/w_out [L, H, E, D]
  transformer.h.i.attn.c_proj.bias    [D]      blocks/attn/b_out [L, D]
  transformer.h.i.ln_2.{weight,bias}  [D]      blocks/ln2/{scale,bias} [L, D]
  transformer.h.i.mlp.c_fc.{weight,bias}    [D, F], [F]   blocks/mlp/{w_fc, b_fc}
  transformer.h.i.mlp.c_proj.{weight,bias}  [F, D], [D]   blocks/mlp/{w_proj, b_proj}
  transformer.ln_f.{weight,bias}      [D]      ln_f/{scale,bias} [D]

The "transformer." prefix is absent in files saved from `GPT2Model` (the Hub's
openai-community/gpt2 among them); both are read, and exports use the prefix. The
output projection is tied to wte, so lm_head.weight is never read or written.
"""

from __future__ import annotations

from meshtrain.errors import UserError
from meshtrain.hf.tensors import Tensor

FAMILY = "gpt2"
MODEL_TYPE = "gpt2"
ARCHITECTURE = "GPT2LMHeadModel"
SUPPORTED = ("meshtrain's gpt2 is Hugging Face's GPT2LMHeadModel with a tied output "
             "embedding, the tanh-approximated gelu (activation_function gelu_new), "
             "LayerNorm eps 1e-5 and attention scaled by 1/sqrt(head width).")
# The tanh-approximated gelu under its names in transformers' ACT2FN.
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def architecture(config: dict, where: str) -> dict:
    """config.json -> the meshtrain gpt2 fields that fix its shapes; UserError for
    settings meshtrain's GPT-2 does not implement."""
    def refuse(what: str):
        raise UserError(f"{where}: {what}, which meshtrain's gpt2 does not implement. {SUPPORTED}")
    act = config.get("activation_function", "gelu_new")
    if act not in TANH_GELUS:
        refuse(f"activation_function is {act!r}")
    if float(config.get("layer_norm_epsilon", 1e-5)) != 1e-5:
        refuse(f"layer_norm_epsilon is {config['layer_norm_epsilon']}")
    if not config.get("scale_attn_weights", True):
        refuse("scale_attn_weights is false")
    if config.get("scale_attn_by_inverse_layer_idx", False):
        refuse("scale_attn_by_inverse_layer_idx is true")
    if config.get("add_cross_attention", False):
        refuse("add_cross_attention is true")
    if not config.get("tie_word_embeddings", True):
        refuse("tie_word_embeddings is false (an untied lm_head)")
    try:
        d, h = int(config["n_embd"]), int(config["n_head"])
        arch = dict(num_layers=int(config["n_layer"]), num_heads=h, embed_dim=d,
                    mlp_dim=int(config.get("n_inner") or 4 * d), vocab_size=int(config["vocab_size"]),
                    seq_len=int(config["n_positions"]))
    except KeyError as e:
        raise UserError(f"{where} lacks {e.args[0]!r}, which every GPT-2 config.json has. "
                        f"Re-save the model with save_pretrained.") from None
    if d % h:
        refuse(f"n_embd={d} is not divisible by n_head={h}")
    return arch


def prefix(names) -> str:
    return "transformer." if "transformer.wte.weight" in set(names) else ""


def ignored_for(arch: dict):
    """Names a file may carry that are not weights of ours: the causal-mask buffers of
    older files, and the tied output's copy of wte."""
    return lambda name: name.endswith((".attn.bias", ".attn.masked_bias")) or name == "lm_head.weight"


def table(arch: dict, p: str = "transformer.") -> list[Tensor]:
    d, h = arch["embed_dim"], arch["num_heads"]
    e = d // h
    layer = p + "h.{i}."
    return [
        Tensor("wte", p + "wte.weight"),
        Tensor("wpe", p + "wpe.weight"),
        Tensor("blocks/ln1/scale", layer + "ln_1.weight"),
        Tensor("blocks/ln1/bias", layer + "ln_1.bias"),
        Tensor("blocks/attn/w_qkv", layer + "attn.c_attn.weight",
               lambda x: x.reshape(d, 3, h, e), lambda x: x.reshape(d, 3 * d)),
        Tensor("blocks/attn/b_qkv", layer + "attn.c_attn.bias",
               lambda x: x.reshape(3, h, e), lambda x: x.reshape(3 * d)),
        Tensor("blocks/attn/w_out", layer + "attn.c_proj.weight",
               lambda x: x.reshape(h, e, d), lambda x: x.reshape(d, d)),
        Tensor("blocks/attn/b_out", layer + "attn.c_proj.bias"),
        Tensor("blocks/ln2/scale", layer + "ln_2.weight"),
        Tensor("blocks/ln2/bias", layer + "ln_2.bias"),
        Tensor("blocks/mlp/w_fc", layer + "mlp.c_fc.weight"),
        Tensor("blocks/mlp/b_fc", layer + "mlp.c_fc.bias"),
        Tensor("blocks/mlp/w_proj", layer + "mlp.c_proj.weight"),
        Tensor("blocks/mlp/b_proj", layer + "mlp.c_proj.bias"),
        Tensor("ln_f/scale", p + "ln_f.weight"),
        Tensor("ln_f/bias", p + "ln_f.bias"),
    ]


def hf_config(arch: dict, base: dict | None, dtype: str, special: dict) -> dict:
    """config.json for GPT2LMHeadModel: `base` (the config converted from, if any) with
    the shape fields set from `arch`; `special` holds token ids to fill in when base lacks them."""
    config = {k: v for k, v in (base or {}).items() if k not in ("architectures", "torch_dtype", "dtype")}
    config.update(
        architectures=[ARCHITECTURE], model_type=MODEL_TYPE, vocab_size=arch["vocab_size"],
        n_positions=arch["seq_len"], n_embd=arch["embed_dim"], n_layer=arch["num_layers"],
        n_head=arch["num_heads"], n_inner=arch["mlp_dim"],
        activation_function=config.get("activation_function", "gelu_new"),
        layer_norm_epsilon=1e-5, tie_word_embeddings=True, dtype=dtype)
    for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop"):
        config.setdefault(key, 0.0)
    for key, value in special.items():  # the source's own ids win
        config.setdefault(key, value)
    return config
