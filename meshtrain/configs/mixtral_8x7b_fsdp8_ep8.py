"""Mixtral 8x7B (46.7B parameters, 12.9B active per token) on 8-way FSDP x 8-way expert
parallelism (64 devices), at 4,096 tokens a row.

    python -m meshtrain.train --config=mixtral_8x7b_fsdp8_ep8 --workdir=runs/mixtral_8x7b

Compile-only check of the layout on any machine (64 simulated CPU devices), with the
per-device memory it needs:

    python -m meshtrain.train --config=mixtral_8x7b_fsdp8_ep8 --config.train.steps=0

Each of the 8 experts lives on one device of each expert group, split by embed over fsdp,
so every device holds 1/64 of the experts' weights and Adam state (they are 97% of the
parameters); attention and the tables split over fsdp only. The batch splits over all 64
devices; each MoE layer's tokens travel to their experts' devices and back by all-to-all
over `expert` (dropless dispatch: models/moe_dropless.py).
"""

from meshtrain.config import base


def get_config():
    c = base(size="mixtral_8x7b", mesh="fsdp:8,expert:8", layout="fsdp_ep")
    c.model.name = "mixtral"
    c.model.dtype = "bfloat16"  # params and Adam state stay float32
    c.model.remat = "full"      # keep only each layer's input
    # 64 rows of 4,096 tokens a step (262,144 tokens), one row a device.
    c.train.update(steps=10_000, batch_size=64, log_every=10, eval_every=1_000, eval_steps=4,
                   loss_chunk=1024)
    c.optim.update(lr=3e-4, min_lr=3e-5, warmup_steps=500, b2=0.95, eps=1e-5, weight_decay=0.1)
    return c
