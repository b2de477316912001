"""GPT-2 tiny on 2-way data x 2 pipeline stages (GPipe, 8 microbatches) x 2-way tensor.

Same model, data and batch as gpt2_tiny_dp8, so the two give the same losses:

    python -m meshtrain.train --config=gpt2_tiny_dp2_pp2_tp2 --config.train.steps=20
"""

from meshtrain.config import base


def get_config():
    c = base(size="tiny", mesh="data:2,stage:2,tensor:2", layout="dp_pp_tp")
    c.pipeline.microbatches = 8  # bubble (S-1)/(M+S-1) = 1/9
    return c
