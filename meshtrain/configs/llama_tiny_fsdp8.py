"""Llama tiny, FSDP / ZeRO-3 over 8 devices: params, grads and Adam state sharded.

    python -m meshtrain.train --config=llama_tiny_fsdp8 --workdir=runs/llama_tiny_fsdp8
"""

from meshtrain.config import base


def get_config():
    c = base(size="tiny", mesh="fsdp:8", layout="fsdp")
    c.model.name = "llama"
    return c
