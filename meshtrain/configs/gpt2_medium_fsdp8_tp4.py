"""GPT-2 medium (355M) on 8-way FSDP x 4-way tensor parallelism (32 devices).

    python -m meshtrain.train --config=gpt2_medium_fsdp8_tp4 --workdir=runs/gpt2_medium_fsdp8_tp4
"""

from meshtrain.config import base


def get_config():
    return base(size="medium", mesh="fsdp:8,tensor:4", layout="fsdp_tp")
