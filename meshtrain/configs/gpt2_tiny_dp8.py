"""GPT-2 tiny (2 layers, d=64) on 8-way data parallelism; seconds per run on CPU.

    python -m meshtrain.train --config=gpt2_tiny_dp8 --workdir=runs/gpt2_tiny_dp8
"""

from meshtrain.config import base


def get_config():
    return base(size="tiny", mesh="data:8", layout="dp")
