"""Llama tiny, 2-way data x 4-way tensor parallelism: 4 query heads split over tensor,
the 2 kv heads computed on every tensor rank and repeated (docs/layouts.md).

    python -m meshtrain.train --config=llama_tiny_dp2_tp4 --workdir=runs/llama_tiny_dp2_tp4
"""

from meshtrain.config import base


def get_config():
    c = base(size="tiny", mesh="data:2,tensor:4", layout="dp_tp")
    c.model.name = "llama"
    return c
