"""Model dimensions by `model.size` (GPT-2 sizes follow Radford et al. 2019)."""

GPT2_SIZES = {
    #          layers heads embed  mlp   vocab  seq_len
    "tiny":   (2,     4,    64,    256,  256,   128),
    "small":  (12,    12,   768,   3072, 50257, 1024),
    "medium": (24,    16,   1024,  4096, 50257, 1024),
    "large":  (36,    20,   1280,  5120, 50257, 1024),
    "xl":     (48,    25,   1600,  6400, 50257, 1024),
}
FIELDS = ("num_layers", "num_heads", "embed_dim", "mlp_dim", "vocab_size", "seq_len")
