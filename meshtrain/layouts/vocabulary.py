"""The logical axis names models may use, and what each one means.

Shapes in model code are written with these names; layouts map them to mesh axes.
Extend this table deliberately: a name outside it is an error, never a silent
replication.
"""

VOCABULARY = {
    "batch": "examples in a (micro)batch",
    "length": "positions in a sequence (also the rows of the position table)",
    "embed": "the residual stream width d_model",
    "heads": "attention heads (query heads)",
    "kv_heads": "key/value heads of grouped-query attention (fewer than heads); presets leave it unsplit",
    "head_dim": "width of one attention head",
    "mlp": "the MLP hidden width (4 x embed in GPT-2, ~8/3 x embed in Llama)",
    "vocab": "token ids: rows of the embedding table, columns of the logits",
    "layers": "the stacked (scanned) layer index",
    "stage": "the pipeline stage index of stacked layers",
}
