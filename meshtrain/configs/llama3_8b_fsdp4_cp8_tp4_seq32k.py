"""Llama 3 8B at 32,768 tokens a row: 4-way FSDP x 8-way context x 4-way tensor
parallelism (128 devices), the long-sequence run.

    python -m meshtrain.train --config=llama3_8b_fsdp4_cp8_tp4_seq32k --workdir=runs/llama3_8b_32k

Compile-only check of the layout on any machine (128 simulated CPU devices):

    python -m meshtrain.train --config=llama3_8b_fsdp4_cp8_tp4_seq32k --config.train.steps=0

Each sequence's positions are split over `context` in the load-balanced zigzag order
(device i holds chunks i and 15-i of 16 chunks of 2,048 tokens: parallel/sequence.py), and
attention passes keys and values round the ring (model.context_attention=ring; `allgather`
is Llama 3's recipe, Dubey et al. 2024 §3.3.2). Heads and the MLP split over tensor, the
kv heads too (as llama3_8b_fsdp8_tp4); weights and Adam state over fsdp. What the step
keeps and sends per device, against the planner's formulas and against the same run with
whole sequences (fsdp:4 x tensor:4): docs/planner.md, "Context parallelism".
"""

from meshtrain.config import base
from meshtrain.parallel.layouts.presets import PRESETS

# fsdp_tp_cp with the kv heads split over tensor too (4 divides the 8 kv heads).
LAYOUT = PRESETS["fsdp_tp_cp"].replace("heads:tensor;", "heads:tensor;kv_heads:tensor;")


def get_config():
    c = base(size="llama3_8b", mesh="fsdp:4,context:8,tensor:4", layout=LAYOUT)
    c.model.name = "llama"
    c.model.seq_len = 32_768
    c.model.context_attention = "ring"
    c.model.dtype = "bfloat16"  # params and Adam state stay float32
    c.model.remat = "full"      # keep only each layer's input: 4,096 positions a device
    # 4 rows of 32,768 tokens a step (131,072 tokens), one row per fsdp shard, its
    # positions split over the 8 context devices.
    c.train.update(steps=2_000, batch_size=4, log_every=10, eval_every=500, eval_steps=4)
    # Llama 2's recipe as llama3_8b_fsdp8_tp4 (Touvron et al. 2023, §2.2), at a lower peak
    # for continued training at a longer context.
    c.optim.update(lr=3e-5, min_lr=3e-6, warmup_steps=100, b2=0.95, eps=1e-5, weight_decay=0.1)
    return c
