"""GPT-2 tiny, 2-way data x 4-way tensor parallelism with Megatron sequence parallelism:
outside attention and the MLP the residual stream, LayerNorms and dropout are split by
position over `tensor`, so each tensor all-reduce becomes a reduce-scatter and an
all-gather (docs/layouts.md, "Long sequences").

    meshtrain train --config=gpt2_tiny_dp2_tp4_sp --workdir=runs/gpt2_tiny_dp2_tp4_sp
"""

from meshtrain.config import base


def get_config():
    return base(size="tiny", mesh="data:2,tensor:4", layout="dp_tp_sp")
