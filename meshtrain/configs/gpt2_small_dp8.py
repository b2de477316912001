"""GPT-2 small (124M) on 8-way data parallelism: 64 x 1024 tokens a step.

    python -m meshtrain.train --config=gpt2_small_dp8 --workdir=runs/gpt2_small_dp8

Compile-only check of the layout on any machine (simulated devices on CPU):

    python -m meshtrain.train --config=gpt2_small_dp8 --config.train.steps=0
"""

from meshtrain.config import base


def get_config():
    c = base(size="small", mesh="data:8", layout="dp")
    c.model.dtype = "bfloat16"  # compute; params and Adam state stay float32
    c.model.remat = "none"
    c.train.update(steps=20_000, batch_size=64, log_every=50, eval_every=1000, eval_steps=20)
    c.optim.update(lr=6e-4, min_lr=6e-4 / 10, warmup_steps=700)
    return c
