"""GPT-2 large (774M), FSDP / ZeRO-3 over 32 devices; matmul outputs saved, the rest recomputed.

    python -m meshtrain.train --config=gpt2_large_fsdp32 --workdir=runs/gpt2_large_fsdp32

Compile-only check of the layout on any machine (simulated devices on CPU):

    python -m meshtrain.train --config=gpt2_large_fsdp32 --config.train.steps=0
"""

from meshtrain.config import base


def get_config():
    c = base(size="large", mesh="fsdp:32", layout="fsdp")
    c.model.dtype = "bfloat16"  # compute; params and Adam state stay float32
    c.model.remat = "save_dots"
    c.train.update(steps=20_000, batch_size=64, log_every=50, eval_every=1000, eval_steps=20)
    c.optim.update(lr=2.5e-4, min_lr=2.5e-4 / 10, warmup_steps=700)
    return c
