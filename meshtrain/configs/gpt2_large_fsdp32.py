"""GPT-2 large (774M), FSDP / ZeRO-3 over 32 devices; matmul outputs saved, the rest recomputed.

    python -m meshtrain.train --config=gpt2_large_fsdp32 --workdir=runs/gpt2_large_fsdp32

Compile-only check of the layout on any machine (simulated devices on CPU):

    python -m meshtrain.train --config=gpt2_large_fsdp32 --config.train.steps=0
"""

from meshtrain.config import gpt2_pretraining


def get_config():
    return gpt2_pretraining(size="large", mesh="fsdp:32", layout="fsdp", lr=2.5e-4, remat="save_dots")
