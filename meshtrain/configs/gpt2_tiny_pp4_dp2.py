"""GPT-2 tiny with 4 layers in 4 pipeline stages (GPipe, 8 microbatches) x 2-way data.

    python -m meshtrain.train --config=gpt2_tiny_pp4_dp2 --workdir=runs/gpt2_tiny_pp4_dp2
"""

from meshtrain.config import base


def get_config():
    c = base(size="tiny", mesh="data:2,stage:4", layout="dp_pp")
    c.model.num_layers = 4       # one layer per stage
    c.pipeline.microbatches = 8  # bubble (S-1)/(M+S-1) = 3/11
    return c
