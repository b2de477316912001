"""Models written with logical axis names; `model_config` turns config keys into dimensions."""

from __future__ import annotations

import math

import ml_collections

from meshtrain.errors import UserError
from meshtrain.models import remat
from meshtrain.models.gpt2 import GPT2, GPT2Config, num_params
from meshtrain.models.sizes import FIELDS, GPT2_SIZES

DTYPES = ("float32", "bfloat16", "float16")


def size_dims(m: ml_collections.ConfigDict) -> dict[str, int]:
    """The dimensions named by model.size, with explicit model.* keys taking precedence."""
    if m.name != "gpt2":
        raise UserError(f"model.name={m.name!r} is not a known model; the models are: gpt2.")
    if m.size not in GPT2_SIZES:
        raise UserError(f"model.size={m.size!r} is not a GPT-2 size; choose one of "
                        f"{', '.join(GPT2_SIZES)} (or set the dimensions explicitly).")
    dims = dict(zip(FIELDS, GPT2_SIZES[m.size]))
    for f in FIELDS:
        if m.get(f) is not None:
            dims[f] = int(m[f])
    return dims


def model_config(m: ml_collections.ConfigDict, *, vocab_size: int, vocab_shards: int = 1) -> GPT2Config:
    """Config keys -> GPT2Config. `model.size` fills dims; explicit keys win.

    `vocab_size` is the data's vocabulary; the table is padded to a multiple of
    lcm(model.vocab_multiple, vocab_shards) so any layout can split it evenly.
    """
    dims = size_dims(m)
    dims["vocab_size"] = vocab_size
    for f, v in dims.items():
        if v < 1:
            raise UserError(f"model.{f}={v}: must be a positive integer.")
    if dims["embed_dim"] % dims["num_heads"]:
        raise UserError(
            f"model.embed_dim={dims['embed_dim']} is not divisible by model.num_heads="
            f"{dims['num_heads']}; the head width would be fractional. Pick num_heads "
            f"dividing {dims['embed_dim']}.")
    for key in ("dtype", "param_dtype"):
        if m[key] not in DTYPES:
            raise UserError(f"model.{key}={m[key]!r}: choose one of {', '.join(DTYPES)}.")
    if not 0.0 <= m.dropout < 1.0:
        raise UserError(f"model.dropout={m.dropout}: must be in [0, 1).")
    remat.check(m.remat)
    multiple = math.lcm(max(1, int(m.vocab_multiple)), vocab_shards)
    padded = -(-vocab_size // multiple) * multiple
    return GPT2Config(**dims, padded_vocab_size=padded, dropout=float(m.dropout),
                      dtype=m.dtype, param_dtype=m.param_dtype, remat=m.remat,
                      scan_layers=bool(m.scan_layers))


__all__ = ["GPT2", "GPT2Config", "model_config", "num_params"]
