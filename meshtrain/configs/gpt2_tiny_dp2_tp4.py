"""GPT-2 tiny, 2-way data x 4-way Megatron tensor parallelism (the README's demo run).

    python -m meshtrain.train --config=gpt2_tiny_dp2_tp4 --workdir=runs/gpt2_tiny_dp2_tp4
"""

from meshtrain.config import base


def get_config():
    return base(size="tiny", mesh="data:2,tensor:4", layout="dp_tp")
