"""Mixtral tiny (4 experts, 2 per token) on data:2,expert:4: expert parallelism, each device one expert of
4; the batch over all 8 devices.

    python -m meshtrain.train --config=mixtral_tiny_dp2_ep4 --workdir=runs/mixtral_tiny_dp2_ep4
"""

from meshtrain.config import base


def get_config():
    c = base(size="tiny", mesh="data:2,expert:4", layout="dp_ep")
    c.model.name = "mixtral"
    return c
