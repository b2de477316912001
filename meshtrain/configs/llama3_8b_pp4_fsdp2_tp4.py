"""Llama 3 8B in 4 pipeline stages x 2-way FSDP x 4-way tensor parallelism (32 devices),
1F1B over 16 microbatches of 2 rows of 8192 tokens.

    python -m meshtrain.train --config=llama3_8b_pp4_fsdp2_tp4 --workdir=runs/llama3_8b_pp4

Compile-only check of the layout on any machine (simulated devices on CPU):

    python -m meshtrain.train --config=llama3_8b_pp4_fsdp2_tp4 --config.train.steps=0

Eight layers per stage. Under 1F1B stage 0 keeps at most 2S-1 = 7 microbatches' stage
inputs where GPipe keeps all 16 microbatches' activations (docs/pipeline.md);
benchmarks/figures/pipeline.py --schedules compares the two compiled (docs/benchmarks.md).
"""

from meshtrain.configs import llama3_8b_fsdp8_tp4
from meshtrain.parallel.layouts.presets import PRESETS

# fsdp_pp_tp with the kv heads split over tensor too (4 divides the 8 kv heads).
LAYOUT = PRESETS["fsdp_pp_tp"].replace("heads:tensor;", "heads:tensor;kv_heads:tensor;")


def get_config():
    """llama3_8b_fsdp8_tp4's model, batch and recipe, on a 4-stage pipeline."""
    c = llama3_8b_fsdp8_tp4.get_config()
    c.mesh.shape, c.layout = "stage:4,fsdp:2,tensor:4", LAYOUT
    c.train.grad_accum_steps = 1  # the pipeline's 16 microbatches take its place
    c.pipeline.update(microbatches=16, schedule="1f1b")  # bubble 3/19 = 15.8%
    return c
