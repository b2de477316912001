"""GPT-2 medium (355M) on 8-way data x 4-way tensor parallelism (32 devices).

    python -m meshtrain.train --config=gpt2_medium_dp8_tp4 --workdir=runs/gpt2_medium_dp8_tp4
"""

from meshtrain.config import base


def get_config():
    return base(size="medium", mesh="data:8,tensor:4", layout="dp_tp")
