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
    "vocab": "the outputs: token ids (rows of the embedding table, columns of the logits) or a classifier's classes",
    "layers": "the stacked (scanned) layer index",
    "stage": "the pipeline stage index of stacked layers",
    "height": "rows of an image activation (spatial layouts split it)",
    "width": "columns of an image activation",
    "channels": "feature maps of an image activation that channel tensor parallelism keeps whole (a conv net's embed)",
    "filters": "feature maps between the two convs of a pair: the first's output, the second's input (split like mlp)",
    "kernel_h": "rows of a convolution kernel",
    "kernel_w": "columns of a convolution kernel",
    "image_channels": "the colour channels of the input image (3 for RGB), never split",
}
