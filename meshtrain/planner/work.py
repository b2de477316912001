"""What one device's step does beyond its matmuls, for the roofline's calibrated terms
(planner/roofline.py): the attention FLOPs a fused kernel runs, and the bytes the
memory-bound kernels pass over, by formula from the config and the layout.

    attention_flops  the compiled program's attention matmuls (scores and values, forward
                     and backward, the forward again under remat): 12 L H Q T a token, the
                     whole [T, T] square, once more by 1/3 where remat recomputes it
    loss_bytes       the loss's passes over its logits (meshtrain/step/loss.py): two reductions
                     (max, sum of exp) read them, the gradient reads them and writes its own,
                     all in the compute dtype: LOSS_PASSES x rows x T x V x itemsize
    layer_bytes      the layers' element-wise kernels (norms, GELU or SwiGLU, biases,
                     residuals, the attention's layout changes, the saved activations'
                     copies), as passes over the activations a layer keeps without remat
                     (the families' layer_activation_bytes, which follow every split of
                     batch, heads, sequence, context and experts): LAYER_PASSES[remat] x that

LAYER_PASSES is measured on an H200, not counted: the planner compiles on the CPU, whose
fusions are not the GPU's (docs/planner.md, "Step time: where the efficiencies come from").
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from meshtrain.planner import analytic
from meshtrain.planner.split_cost import local_batch

LOSS_PASSES = 4
# Passes over a layer's no-remat activations by remat policy, from the H200 runs above (at
# the card's elementwise_efficiency, planner/hardware.py). save_dots is not measured: taken
# as none's (it saves as many tensors and copies them alike).
LAYER_PASSES = {"none": 10.0, "save_dots": 10.0, "full": 8.6}
REMAT_ATTENTION = {"none": 1.0, "save_dots": 1.0, "full": 4 / 3}  # the forward's 4 of 12 again


def step_work(exp, hw) -> dict | None:
    """{"attention_flops", "attention_kernel", "head_dim", "loss_bytes", "layer_bytes"} per
    device per step for a language model with a per-layer activation formula, else None
    (the roofline then keeps its coarse memory term)."""
    m = exp.model
    per_layer = m.family.layer_activation_bytes
    if m.family.task != "lm" or per_layer is None:
        return None
    b, pipe = local_batch(exp), m.pipeline
    kernel = analytic.attention_on(exp, hw)
    cfg = dataclasses.replace(m.cfg, attention=kernel)
    n, split = analytic.layer_splits(exp)
    rows = b["pipeline_rows"] if pipe is not None else b["rows"]  # one microbatch on this device
    layers = cfg.num_layers // (pipe.stages if pipe is not None else 1)
    tokens = rows * cfg.seq_len / n
    runs = b["micro"]  # microbatches a step runs through each layer
    layer_bytes = per_layer(cfg, tokens, b["tensor"], "none", **split) * layers * runs
    # A model from outside meshtrain need not have attention heads (models/family.py's seam)
    heads_local, head_dim = getattr(cfg, "num_heads", 0) / b["tensor"], getattr(cfg, "head_dim", 0)
    attention = (12.0 * layers * heads_local * head_dim * cfg.seq_len * tokens * runs
                 * REMAT_ATTENTION.get(cfg.remat, 1.0))
    itemsize = jnp.dtype(cfg.dtype).itemsize
    head_rows = b["rows"] * exp.cfg.train.grad_accum_steps / n  # a step's rows on this device's batch shard
    logits = head_rows * cfg.seq_len * cfg.padded_vocab_size / b["vocab"]
    return {"attention_flops": attention, "attention_kernel": kernel, "head_dim": head_dim,
            "loss_bytes": LOSS_PASSES * logits * itemsize,
            "layer_bytes": LAYER_PASSES.get(cfg.remat, LAYER_PASSES["none"]) * layer_bytes}
