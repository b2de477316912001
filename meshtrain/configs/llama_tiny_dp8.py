"""Llama tiny (2 layers, d=64, 4 heads over 2 kv heads) on 8-way data parallelism.

    python -m meshtrain.train --config=llama_tiny_dp8 --workdir=runs/llama_tiny_dp8
"""

from meshtrain.config import base


def get_config():
    c = base(size="tiny", mesh="data:8", layout="dp")
    c.model.name = "llama"
    return c
