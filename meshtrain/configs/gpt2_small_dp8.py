"""GPT-2 small (124M) on 8-way data parallelism.

    python -m meshtrain.train --config=gpt2_small_dp8 --workdir=runs/gpt2_small_dp8
"""

from meshtrain.config import base


def get_config():
    return base(size="small", mesh="data:8", layout="dp")
