"""GPT-2 tiny, 8-way data parallelism with ZeRO-2: Adam state and gradients sharded over
data (each layer's gradient reduce-scattered inside the backward pass), params replicated.

    python -m meshtrain.train --config=gpt2_tiny_dp8_zero2 --workdir=runs/gpt2_tiny_dp8_zero2
"""

from meshtrain.config import base


def get_config():
    return base(size="tiny", mesh="data:8", layout="zero2")
