"""GPT-2 medium (355M, 24 layers) on 2-way data x 4 pipeline stages x 4-way tensor (32 devices).

Six layers per stage, GPipe over 16 microbatches of 4 sequences (2 per data shard):
bubble (S-1)/(M+S-1) = 3/19 = 15.8%.

    python -m meshtrain.train --config=gpt2_medium_dp2_pp4_tp4 --workdir=runs/gpt2_medium_dp2_pp4_tp4

Compile-only check of the layout on any machine (simulated devices on CPU):

    python -m meshtrain.train --config=gpt2_medium_dp2_pp4_tp4 --config.train.steps=0
"""

from meshtrain.config import gpt2_pretraining


def get_config():
    c = gpt2_pretraining(size="medium", mesh="data:2,stage:4,tensor:4", layout="dp_pp_tp", lr=3e-4)
    c.pipeline.microbatches = 16
    return c
