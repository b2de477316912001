"""GPT-2 tiny in 2 pipeline stages (GPipe, 4 microbatches) x 4-way data parallelism.

    python -m meshtrain.train --config=gpt2_tiny_pp2_dp4 --workdir=runs/gpt2_tiny_pp2_dp4
"""

from meshtrain.config import base


def get_config():
    c = base(size="tiny", mesh="data:4,stage:2", layout="dp_pp")
    c.pipeline.microbatches = 4  # bubble (S-1)/(M+S-1) = 1/5
    return c
