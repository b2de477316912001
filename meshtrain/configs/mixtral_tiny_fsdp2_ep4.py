"""Mixtral tiny (4 experts, 2 per token) on fsdp:2,expert:4: the experts over expert, every weight and its
Adam state also split by embed over fsdp.

    python -m meshtrain.train --config=mixtral_tiny_fsdp2_ep4 --workdir=runs/mixtral_tiny_fsdp2_ep4
"""

from meshtrain.config import base


def get_config():
    c = base(size="tiny", mesh="fsdp:2,expert:4", layout="fsdp_ep")
    c.model.name = "mixtral"
    return c
