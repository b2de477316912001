"""GPT-2 small (124M) on 8-way data parallelism: 64 x 1024 tokens a step.

    python -m meshtrain.train --config=gpt2_small_dp8 --workdir=runs/gpt2_small_dp8

Compile-only check of the layout on any machine (simulated devices on CPU):

    python -m meshtrain.train --config=gpt2_small_dp8 --config.train.steps=0
"""

from meshtrain.config import gpt2_pretraining


def get_config():
    return gpt2_pretraining(size="small", mesh="data:8", layout="dp", lr=6e-4)
