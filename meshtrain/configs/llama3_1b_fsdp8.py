"""Llama 3.2 1B (tied embedding, Llama 3 RoPE scaling) on 8-way FSDP, at 8192 tokens a row.

    python -m meshtrain.train --config=llama3_1b_fsdp8 --workdir=runs/llama3_1b

Compile-only check on any machine (simulated devices on CPU):

    python -m meshtrain.train --config=llama3_1b_fsdp8 --config.train.steps=0
"""

from meshtrain.config import base


def get_config():
    c = base(size="llama3_1b", mesh="fsdp:8", layout="fsdp")
    c.model.name = "llama"
    c.model.dtype = "bfloat16"  # params and Adam state stay float32
    c.model.remat = "full"
    # 16 x 8192 = 131,072 tokens a step: 2 rows per device, one per microbatch (the
    # compile-only check on CPU estimates 42 GiB a device, 75 GiB in one microbatch:
    # all 32 heads' attention scores [8192, 8192] are on every device under fsdp).
    c.train.update(steps=20_000, batch_size=16, grad_accum_steps=2, log_every=50, eval_every=1000,
                   eval_steps=20)
    c.optim.update(lr=3e-4, min_lr=3e-5, warmup_steps=2000, b2=0.95, eps=1e-5, weight_decay=0.1)
    return c
