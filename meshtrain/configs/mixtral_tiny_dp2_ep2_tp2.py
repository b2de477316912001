"""Mixtral tiny (4 experts, 2 per token) on data:2,expert:2,tensor:2: the experts over expert,
each expert's mlp, the heads and the vocabulary over tensor.

    python -m meshtrain.train --config=mixtral_tiny_dp2_ep2_tp2 --workdir=runs/mixtral_tiny_dp2_ep2_tp2
"""

from meshtrain.config import base


def get_config():
    c = base(size="tiny", mesh="data:2,expert:2,tensor:2", layout="dp_ep_tp")
    c.model.name = "mixtral"
    return c
