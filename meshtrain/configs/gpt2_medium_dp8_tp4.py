"""GPT-2 medium (355M) on 8-way data x 4-way tensor parallelism (32 devices).

    python -m meshtrain.train --config=gpt2_medium_dp8_tp4 --workdir=runs/gpt2_medium_dp8_tp4

Compile-only check of the layout on any machine (simulated devices on CPU):

    python -m meshtrain.train --config=gpt2_medium_dp8_tp4 --config.train.steps=0
"""

from meshtrain.config import gpt2_pretraining


def get_config():
    return gpt2_pretraining(size="medium", mesh="data:8,tensor:4", layout="dp_tp", lr=3e-4)
