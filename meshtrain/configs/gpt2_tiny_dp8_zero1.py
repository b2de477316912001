"""GPT-2 tiny, 8-way data parallelism with ZeRO-1: Adam state sharded over data, params replicated.

    python -m meshtrain.train --config=gpt2_tiny_dp8_zero1 --workdir=runs/gpt2_tiny_dp8_zero1
"""

from meshtrain.config import base


def get_config():
    return base(size="tiny", mesh="data:8", layout="zero1")
