"""GPT-2 tiny, FSDP / ZeRO-3 over 8 devices: params, grads and Adam state sharded.

    python -m meshtrain.train --config=gpt2_tiny_fsdp8 --workdir=runs/gpt2_tiny_fsdp8
"""

from meshtrain.config import base


def get_config():
    return base(size="tiny", mesh="fsdp:8", layout="fsdp")
