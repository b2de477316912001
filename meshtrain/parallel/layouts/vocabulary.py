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
    # Mixtures of experts (models/moe.py; docs/layouts.md "Experts").
    "experts": "the experts of a mixture-of-experts layer: the stacked dim of its expert weights, "
               "the router's outputs and the capacity dispatch's per-expert buffers",
    # Image models (models/conv.py, vgg.py, resnet.py; docs/models.md "Image families").
    "height": "rows of an image activation (spatial layouts split it; convs exchange halos)",
    "width": "columns of an image activation",
    "channels": "feature maps a conv net keeps whole under tensor parallelism (its embed); "
                "also BatchNorm's dim after such a conv",
    "filters": "feature maps between the two convs of a channel-parallel pair (its mlp): "
               "the first conv's outputs, the second's inputs",
    "kernel_h": "rows of a conv kernel (never split)",
    "kernel_w": "columns of a conv kernel (never split)",
    "image_channels": "colour channels of the input image (3; never split)",
}
