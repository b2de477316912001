"""GPT-2 large (774M), FSDP / ZeRO-3 over 32 devices.

    python -m meshtrain.train --config=gpt2_large_fsdp32 --workdir=runs/gpt2_large_fsdp32
"""

from meshtrain.config import base


def get_config():
    return base(size="large", mesh="fsdp:32", layout="fsdp")
