"""Model dimensions by `model.size`, per family. Fields named like a `model.*` key are
overridden by that key when it is set.

GPT-2 sizes follow Radford et al. 2019; Llama sizes follow the released configs
(Touvron et al. 2023; Meta's Llama 3 and 3.2 model cards).

Llama sizes name their release: llama3_8b is Llama 3 8B, llama3_1b is Llama 3.2 1B.
"""


def _gpt2(layers, heads, embed, mlp, vocab, seq_len):
    return dict(num_layers=layers, num_heads=heads, embed_dim=embed, mlp_dim=mlp,
                vocab_size=vocab, seq_len=seq_len)


GPT2_SIZES = {
    "tiny": _gpt2(2, 4, 64, 256, 256, 128),
    "small": _gpt2(12, 12, 768, 3072, 50257, 1024),
    "medium": _gpt2(24, 16, 1024, 4096, 50257, 1024),
    "large": _gpt2(36, 20, 1280, 5120, 50257, 1024),
    "xl": _gpt2(48, 25, 1600, 6400, 50257, 1024),
}


# Llama 3.1 frequency scaling as Hugging Face's config.json writes it (rope_type llama3).
_LLAMA3_SCALING_32 = dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192)


def _llama(layers, heads, kv_heads, embed, mlp, vocab, seq_len, theta, tied, scaling=None, eps=1e-5,
           max_positions=None):
    """rope_scaling, max_position_embeddings (the context supported at inference; None:
    seq_len) and norm_eps have no model.* key: they come from this table only."""
    return dict(num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, embed_dim=embed,
                mlp_dim=mlp, vocab_size=vocab, seq_len=seq_len, rope_theta=theta,
                tie_embeddings=tied, rope_scaling=scaling, max_position_embeddings=max_positions,
                norm_eps=eps)


LLAMA_SIZES = {
    "tiny": _llama(2, 4, 2, 64, 192, 256, 128, 10_000.0, False),
    # Llama 3.2 1B (1,235,814,400 params). seq_len 8192: the context Llama 3 pretrained at
    # (the scaling's original_max_position_embeddings), so a converted checkpoint trains
    # at its native length; the scaled RoPE reaches 128K when seq_len is raised.
    "llama3_1b": _llama(16, 32, 8, 2048, 8192, 128_256, 8192, 500_000.0, True, _LLAMA3_SCALING_32,
                        max_positions=131_072),
    # Llama 2 7B (6,738,415,616 params).
    "llama2_7b": _llama(32, 32, 32, 4096, 11008, 32_000, 4096, 10_000.0, False),
    # Llama 3 8B (8,030,261,248 params); no RoPE scaling (that came with 3.1).
    "llama3_8b": _llama(32, 32, 8, 4096, 14336, 128_256, 8192, 500_000.0, False),
}


def _mixtral(layers, heads, kv_heads, embed, mlp, vocab, seq_len, experts, k, theta, max_positions,
             shared=0):
    """A Llama with `experts` SwiGLU experts of width mlp per block, k per token, and
    `shared` always-on experts (models/mixtral.py)."""
    return dict(_llama(layers, heads, kv_heads, embed, mlp, vocab, seq_len, theta, False,
                       max_positions=max_positions),
                num_experts=experts, experts_per_token=k, num_shared_experts=shared)


MIXTRAL_SIZES = {
    # Its dense twin of equal active parameters (but the router's D X) is Llama tiny with
    # model.mlp_dim=256: k experts of width 128 per token.
    "tiny": _mixtral(2, 4, 2, 64, 128, 256, 128, 4, 2, 10_000.0, None),
    # Mixtral 8x7B (Jiang et al. 2024: 46.7B parameters, 12.9B active per token), at 4K of
    # its 32K context.
    "mixtral_8x7b": _mixtral(32, 32, 8, 4096, 14336, 32_000, 4096, 8, 2, 1_000_000.0, 32_768),
    # Mixtral 8x22B (141B parameters, 39B active).
    "mixtral_8x22b": _mixtral(56, 48, 8, 6144, 16384, 32_768, 4096, 8, 2, 1_000_000.0, 65_536),
}
