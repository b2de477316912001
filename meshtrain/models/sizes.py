"""Model dimensions by `model.size`, per family. Fields named like a `model.*` key are
overridden by that key when it is set.

GPT-2 sizes follow Radford et al. 2019; Llama sizes follow the released configs
(Touvron et al. 2023; Meta's Llama 3 and 3.2 model cards).
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
