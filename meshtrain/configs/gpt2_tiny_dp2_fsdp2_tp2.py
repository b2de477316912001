"""GPT-2 tiny on data=2 x fsdp=2 x tensor=2: every kind of non-pipeline sharding at once.

    python -m meshtrain.train --config=gpt2_tiny_dp2_fsdp2_tp2 --workdir=runs/gpt2_tiny_dp2_fsdp2_tp2
"""

from meshtrain.config import base


def get_config():
    return base(size="tiny", mesh="data:2,fsdp:2,tensor:2", layout="fsdp_tp")
