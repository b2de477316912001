"""Llama tiny in 2 pipeline stages (GPipe, 4 microbatches) x 4-way data parallelism.

    python -m meshtrain.train --config=llama_tiny_pp2_dp4 --workdir=runs/llama_tiny_pp2_dp4
"""

from meshtrain.config import base


def get_config():
    c = base(size="tiny", mesh="data:4,stage:2", layout="dp_pp")
    c.model.name = "llama"
    c.pipeline.microbatches = 4  # bubble (S-1)/(M+S-1) = 1/5
    return c
