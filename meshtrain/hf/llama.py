"""Llama <-> Hugging Face `LlamaForCausalLM` (model_type "llama").

Hugging Face stores nn.Linear weights [out, in]; ours are [in, out] with heads split
out, so each maps by a transpose and a reshape. RoPE in both is "rotate_half", so q
and k need no permutation (D embed, H heads, K kv heads, E head width, F mlp):

  model.embed_tokens.weight                 [V, D]     embed [V, D]
  model.layers.i.input_layernorm.weight     [D]        blocks/attn_norm/scale [L, D]
  model.layers.i.self_attn.q_proj.weight    [H*E, D]   blocks/attn/wq [L, D, H, E]
  model.layers.i.self_attn.{k,v}_proj.weight [K*E, D]  blocks/attn/{wk,wv} [L, D, K, E]
  model.layers.i.self_attn.o_proj.weight    [D, H*E]   blocks/attn/wo [L, H, E, D]
  model.layers.i.post_attention_layernorm.weight [D]   blocks/mlp_norm/scale [L, D]
  model.layers.i.mlp.{gate,up}_proj.weight  [F, D]     blocks/mlp/{w_gate,w_up} [L, D, F]
  model.layers.i.mlp.down_proj.weight       [D, F]     blocks/mlp/w_down [L, F, D]
  model.norm.weight                         [D]        final_norm/scale [D]
  lm_head.weight                            [V, D]     lm_head [D, V] (untied only)

RoPE settings are read from both config.json forms: transformers 4's `rope_theta` +
`rope_scaling` and transformers 5's `rope_parameters`; exports write the first, which
both versions read.
"""

from __future__ import annotations

from meshtrain.errors import UserError
from meshtrain.hf.tensors import Tensor

FAMILY = "llama"
MODEL_TYPE = "llama"
ARCHITECTURE = "LlamaForCausalLM"
SUPPORTED = ("meshtrain's llama is Hugging Face's LlamaForCausalLM with silu MLPs, no "
             "attention or MLP biases, head_dim = hidden_size / num_attention_heads, and RoPE "
             "that is plain (rope_type default) or Llama 3.1's (rope_type llama3); the output "
             "embedding may be tied or untied.")
SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def rope_settings(config: dict, refuse) -> tuple[float, dict | None]:
    """(rope_theta, llama3 scaling dict or None) from either config.json form."""
    params = config.get("rope_parameters")
    if params and not ("rope_type" in params or "rope_theta" in params):
        refuse("rope_parameters is given per layer type, which Llama does not use")
    scaling = config.get("rope_scaling")
    theta = config.get("rope_theta")
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        scaling = params
    kind = None if not scaling else scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return float(theta if theta is not None else 10_000.0), None
    if kind != "llama3":
        refuse(f"its rope scaling is of type {kind!r}")
    missing = [k for k in SCALING_KEYS if k not in scaling]
    if missing:
        refuse(f"its llama3 rope scaling lacks {', '.join(missing)}")
    out = {k: float(scaling[k]) for k in SCALING_KEYS}
    out["original_max_position_embeddings"] = int(scaling["original_max_position_embeddings"])
    return float(theta if theta is not None else 10_000.0), out


def architecture(config: dict, where: str, family: str = FAMILY, supported: str = SUPPORTED) -> dict:
    """config.json -> the meshtrain llama fields that fix its shapes (and its RoPE); a
    UserError for settings meshtrain's Llama does not implement. `family` and `supported`
    name the model in messages (hf/mixtral.py reads its attention with this)."""
    def refuse(what: str):
        raise UserError(f"{where}: {what}, which meshtrain's {family} does not implement. {supported}")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        refuse(f"hidden_act is {act!r}")
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key, False):
            refuse(f"{key} is true")
    try:
        d, h = int(config["hidden_size"]), int(config["num_attention_heads"])
        layers, mlp, vocab = int(config["num_hidden_layers"]), int(config["intermediate_size"]), int(config["vocab_size"])
    except KeyError as e:
        raise UserError(f"{where} lacks {e.args[0]!r}, which every {family} config.json has. "
                        f"Re-save the model with save_pretrained.") from None
    if d % h:
        refuse(f"hidden_size={d} is not divisible by num_attention_heads={h}")
    head_dim = config.get("head_dim")
    if head_dim is not None and int(head_dim) != d // h:
        refuse(f"head_dim={head_dim} differs from hidden_size / num_attention_heads = {d // h}")
    theta, scaling = rope_settings(config, refuse)
    # The context it was pretrained at: with Llama 3.1 scaling, the original length, as
    # sizes.py; the scaled RoPE reaches max_position_embeddings, the context it supports
    # (sampling's --max_len goes up to it; training raises seq_len to use it).
    max_positions = int(config.get("max_position_embeddings", 2048))
    seq_len = int(scaling["original_max_position_embeddings"]) if scaling else max_positions
    return dict(num_layers=layers, num_heads=h, num_kv_heads=int(config.get("num_key_value_heads") or h),
                embed_dim=d, mlp_dim=mlp, vocab_size=vocab, seq_len=seq_len, rope_theta=theta,
                rope_scaling=scaling, max_position_embeddings=max_positions,
                tie_embeddings=bool(config.get("tie_word_embeddings", False)),
                norm_eps=float(config.get("rms_norm_eps", 1e-6)))


def prefix(names) -> str:
    return "model."


def table(arch: dict, p: str = "model.") -> list[Tensor]:
    d, h, k = arch["embed_dim"], arch["num_heads"], arch["num_kv_heads"]
    e = d // h
    layer = p + "layers.{i}."

    def heads(n):  # [n*E, D] <-> [D, n, E]
        return (lambda x: x.T.reshape(d, n, e), lambda x: x.reshape(d, n * e).T)

    entries = [
        Tensor("embed", p + "embed_tokens.weight"),
        Tensor("blocks/attn_norm/scale", layer + "input_layernorm.weight"),
        Tensor("blocks/attn/wq", layer + "self_attn.q_proj.weight", *heads(h)),
        Tensor("blocks/attn/wk", layer + "self_attn.k_proj.weight", *heads(k)),
        Tensor("blocks/attn/wv", layer + "self_attn.v_proj.weight", *heads(k)),
        Tensor("blocks/attn/wo", layer + "self_attn.o_proj.weight",
               lambda x: x.T.reshape(h, e, d), lambda x: x.reshape(h * e, d).T),
        Tensor("blocks/mlp_norm/scale", layer + "post_attention_layernorm.weight"),
        Tensor("blocks/mlp/w_gate", layer + "mlp.gate_proj.weight", lambda x: x.T, lambda x: x.T),
        Tensor("blocks/mlp/w_up", layer + "mlp.up_proj.weight", lambda x: x.T, lambda x: x.T),
        Tensor("blocks/mlp/w_down", layer + "mlp.down_proj.weight", lambda x: x.T, lambda x: x.T),
        Tensor("final_norm/scale", p + "norm.weight"),
    ]
    if not arch["tie_embeddings"]:
        entries.append(Tensor("lm_head", "lm_head.weight", lambda x: x.T, lambda x: x.T))
    return entries


def ignored_for(arch: dict):
    """Names a file may carry that are not weights of ours: RoPE's inverse frequencies
    (old files), and lm_head.weight when the output is tied (a copy of the embedding)."""
    tied = arch["tie_embeddings"]
    return lambda name: name.endswith(".rotary_emb.inv_freq") or (tied and name == "lm_head.weight")


def hf_config(arch: dict, base: dict | None, dtype: str, special: dict) -> dict:
    """config.json for LlamaForCausalLM: `base` (the config converted from, if any) with
    the fields of `arch`; `special` holds token ids to fill in when base lacks them."""
    drop = ("architectures", "torch_dtype", "dtype", "rope_parameters", "rope_scaling", "rope_theta")
    config = {k: v for k, v in (base or {}).items() if k not in drop}
    d, h = arch["embed_dim"], arch["num_heads"]
    scaling = arch.get("rope_scaling")
    max_pos = max(int(config.get("max_position_embeddings", 0)), arch["seq_len"],
                  arch.get("max_position_embeddings") or 0)
    config.update(
        architectures=[ARCHITECTURE], model_type=MODEL_TYPE, vocab_size=arch["vocab_size"],
        hidden_size=d, intermediate_size=arch["mlp_dim"], num_hidden_layers=arch["num_layers"],
        num_attention_heads=h, num_key_value_heads=arch["num_kv_heads"], head_dim=d // h,
        max_position_embeddings=max_pos, rms_norm_eps=arch["norm_eps"],
        rope_theta=arch["rope_theta"],
        rope_scaling=None if scaling is None else {"rope_type": "llama3", **scaling},
        tie_word_embeddings=bool(arch["tie_embeddings"]), hidden_act="silu",
        attention_bias=False, mlp_bias=False, dtype=dtype)
    for key, value in special.items():  # the source's own ids win
        config.setdefault(key, value)
    return config
