"""Llama 3 8B in 4 pipeline stages x 2-way FSDP x 4-way tensor parallelism (32 devices),
1F1B over 16 microbatches of 2 rows of 8192 tokens.

    python -m meshtrain.train --config=llama3_8b_pp4_fsdp2_tp4 --workdir=runs/llama3_8b_pp4

Compile-only check of the layout on any machine (simulated devices on CPU):

    python -m meshtrain.train --config=llama3_8b_pp4_fsdp2_tp4 --config.train.steps=0

Eight layers per stage. Under 1F1B stage 0 keeps at most 2S-1 = 7 microbatches' stage
inputs where GPipe keeps all 16 microbatches' activations (docs/pipeline.md);
benchmarks/pipeline.py --schedules compares the two compiled (docs/benchmarks.md).
"""

from meshtrain.config import base
from meshtrain.layouts.presets import PRESETS

# fsdp_pp_tp with the kv heads split over tensor too (4 divides the 8 kv heads).
LAYOUT = PRESETS["fsdp_pp_tp"].replace("heads:tensor;", "heads:tensor;kv_heads:tensor;")


def get_config():
    c = base(size="llama3_8b", mesh="stage:4,fsdp:2,tensor:4", layout=LAYOUT)
    c.model.name = "llama"
    c.model.dtype = "bfloat16"  # params and Adam state stay float32
    c.model.remat = "full"      # keep only each layer's input: 8192-token rows
    c.pipeline.update(microbatches=16, schedule="1f1b")  # bubble 3/19 = 15.8%
    c.train.update(steps=20_000, batch_size=32, log_every=50, eval_every=1000, eval_steps=20)
    # Llama 2's recipe (Touvron et al. 2023, section 2.2), as llama3_8b_fsdp8_tp4.
    c.optim.update(lr=3e-4, min_lr=3e-5, warmup_steps=2000, b2=0.95, eps=1e-5, weight_decay=0.1)
    return c
