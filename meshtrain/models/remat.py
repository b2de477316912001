"""Rematerialisation policies by name, applied to one transformer layer.

  none       keep every activation for the backward pass (fastest, most memory)
  full       keep only the layer input; recompute the layer in backward
             (activation memory ~ 2 s b h bytes per layer in 16-bit, Korthikanti et al.)
  save_dots  keep the outputs of matmuls without batch dims (the projections) and
             recompute the cheap element-wise ops and attention softmax
"""

from collections.abc import Callable

import jax

from meshtrain.errors import UserError

POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def check(name: str) -> None:
    if name not in POLICIES:
        raise UserError(
            f"model.remat={name!r} is not a remat policy. Choose one of: "
            f"{', '.join(POLICIES)} (see meshtrain/models/remat.py).")


def wrap(fn: Callable, name: str) -> Callable:
    check(name)
    if name == "none":
        return fn
    return jax.checkpoint(fn, policy=POLICIES[name], prevent_cse=False)
