"""GPT-2 medium (355M) on 8-way FSDP x 4-way tensor parallelism (32 devices).

    python -m meshtrain.train --config=gpt2_medium_fsdp8_tp4 --workdir=runs/gpt2_medium_fsdp8_tp4

Compile-only check of the layout on any machine (simulated devices on CPU):

    python -m meshtrain.train --config=gpt2_medium_fsdp8_tp4 --config.train.steps=0
"""

from meshtrain.config import gpt2_pretraining


def get_config():
    return gpt2_pretraining(size="medium", mesh="fsdp:8,tensor:4", layout="fsdp_tp", lr=3e-4)
