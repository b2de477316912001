"""Mixtral tiny (2 layers, d=64, 4 experts of mlp 128, 2 per token) on 8-way data parallelism.

    python -m meshtrain.train --config=mixtral_tiny_dp8 --workdir=runs/mixtral_tiny_dp8

Dropless dispatch; `--config.moe.dispatch=capacity` runs GShard's capacity buffers instead.
"""

from meshtrain.config import base


def get_config():
    c = base(size="tiny", mesh="data:8", layout="dp")
    c.model.name = "mixtral"
    return c
