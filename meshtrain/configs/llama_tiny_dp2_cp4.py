"""Llama tiny on 512-token sequences, 2-way data x 4-way context parallelism: each sequence's
positions split over `context` in zigzag order (device i holds chunks i and 7-i of 8), and
attention by a load-balanced ring of key/value permutes (docs/layouts.md, "Long sequences").

    meshtrain train --config=llama_tiny_dp2_cp4 --workdir=runs/llama_tiny_dp2_cp4
    --config.model.context_attention=allgather gathers the keys and values instead
"""

from meshtrain.config import base


def get_config():
    c = base(size="tiny", mesh="data:2,context:4", layout="dp_cp")
    c.model.name = "llama"
    c.model.seq_len = 512
    c.model.context_attention = "ring"
    c.train.loss_chunk = 128  # a multiple of the 4 pieces: each chunk takes 32 rows from each
    return c
