"""GPT-2 tiny with 8 layers in 4 pipeline stages, circular schedule with 2 repeats
(each device holds layers s and s+4), 8 microbatches, x 2-way data.

    python -m meshtrain.train --config=gpt2_tiny_pp4_dp2_circular --workdir=runs/circular
"""

from meshtrain.config import base


def get_config():
    c = base(size="tiny", mesh="data:2,stage:4", layout="dp_pp")
    c.model.num_layers = 8
    c.pipeline.update(microbatches=8, schedule="circular", repeats=2)  # bubble 3/(2*8+3) = 3/19
    return c
