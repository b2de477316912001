"""GPT-2 medium (355M) on 8-way data x 4-way tensor parallelism (32 devices).

    python -m meshtrain.train --config=gpt2_medium_dp8_tp4 --workdir=runs/gpt2_medium_dp8_tp4

Compile-only check of the layout on any machine (simulated devices on CPU):

    python -m meshtrain.train --config=gpt2_medium_dp8_tp4 --config.train.steps=0
"""

from meshtrain.config import base


def get_config():
    c = base(size="medium", mesh="data:8,tensor:4", layout="dp_tp")
    c.model.dtype = "bfloat16"  # compute; params and Adam state stay float32
    c.model.remat = "none"
    c.train.update(steps=20_000, batch_size=64, log_every=50, eval_every=1000, eval_steps=20)
    c.optim.update(lr=3e-4, min_lr=3e-4 / 10, warmup_steps=700)
    return c
