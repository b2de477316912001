"""Llama 3 8B on 8-way FSDP x 4-way tensor parallelism (32 devices), at 8192 tokens a row.

    python -m meshtrain.train --config=llama3_8b_fsdp8_tp4 --workdir=runs/llama3_8b

Compile-only check of the layout on any machine (simulated devices on CPU):

    python -m meshtrain.train --config=llama3_8b_fsdp8_tp4 --config.train.steps=0

The 32 query heads split over tensor (8 each), and so do the 8 kv heads (2 each): the
fsdp_tp preset plus `kv_heads:tensor` in every table, as the linter advises. Against
fsdp_tp as is, which projects all 8 kv heads on every tensor rank (docs/layouts.md,
"Grouped-query attention"), the planner finds 288 MiB less state per device, no tensor
all-gathers and 9% less collective traffic (docs/planner.md).
"""

from meshtrain.config import base
from meshtrain.parallel.layouts.presets import PRESETS

# fsdp_tp with the kv heads split over tensor too (4 divides the 8 kv heads).
LAYOUT = PRESETS["fsdp_tp"].replace("heads:tensor;", "heads:tensor;kv_heads:tensor;")


def get_config():
    c = base(size="llama3_8b", mesh="fsdp:8,tensor:4", layout=LAYOUT)
    c.model.name = "llama"
    c.model.dtype = "bfloat16"  # params and Adam state stay float32
    c.model.remat = "full"      # keep only each layer's input: 8192-token rows
    # 32 x 8192 = 262,144 tokens a step, 4 rows per fsdp shard in 2 microbatches of 2:
    # the compile-only check on CPU estimates a 32 GiB peak per device (54 GiB in one
    # microbatch, 20 GiB in 4; attention scores [rows, 8 heads, 8192, 8192] dominate).
    c.train.update(steps=20_000, batch_size=32, grad_accum_steps=2, log_every=50, eval_every=1000,
                   eval_steps=20)
    # Llama 2's recipe (Touvron et al. 2023, section 2.2): AdamW b2 0.95, eps 1e-5, weight
    # decay 0.1, clip 1.0, 2000 warmup steps, cosine to 10% of the peak.
    c.optim.update(lr=3e-4, min_lr=3e-5, warmup_steps=2000, b2=0.95, eps=1e-5, weight_decay=0.1)
    return c
