"""Rematerialisation policies by name, applied to one transformer layer.

  none          keep every activation for the backward pass (fastest, most memory)
  full          keep only the layer input; recompute the layer in backward
                (activation memory ~ 2 s b h bytes per layer in 16-bit, Korthikanti et al.)
  save_dots     keep the outputs of matmuls without batch dims (the projections) and
                recompute the cheap element-wise ops and attention softmax
  offload_dots  save_dots' projections kept in host memory instead of the device's
                (vDNN's idea; JAX's offload_dot_with_no_batch_dims)
  offload:NAMES the activations the models tag with those names (TAGS, a comma list)
                kept in host memory, the rest recomputed: offload:qkv keeps the
                attention's inputs (MaxText's qkv_proj_offloaded)

The offload policies need a backend with host memory ("pinned_host": GPUs, and the CPU,
where the move lowers to nothing); parallel/offload.py checks the devices.
"""

from collections.abc import Callable

import jax

from meshtrain.errors import UserError

POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
HOST = "pinned_host"
# Activation names the models tag (jax.ad_checkpoint.checkpoint_name), in layer order:
#   qkv       the attention's query, key and value projections (GPT-2's one [B, T, 3, H, E];
#             Llama's q [B, T, H, E], k and v [B, T, K, E])
#   attn_out  the attention's output projection [B, T, D]
#   mlp_up    the MLP's first matmul ([B, T, F]; SwiGLU's gate and up [B, T, 2, F])
#   mlp_down  the MLP's last matmul [B, T, D]
TAGS = ("qkv", "attn_out", "mlp_up", "mlp_down")
OFFLOAD = "offload:"
# The checkpoint name of a layer's parameters as they arrive from host memory (train.offload
# =params, parallel/offload.py): no policy keeps them for the backward, which fetches its
# layer again, so only about one layer's parameters are on the device at a time.
FETCHED = "fetched_params"


def offloaded_tags(name: str) -> tuple[str, ...]:
    """The TAGS an offload:NAMES policy keeps in host memory ("offload:qkv,mlp_up" ->
    ("qkv", "mlp_up")); () for any other policy."""
    if not name.startswith(OFFLOAD):
        return ()
    return tuple(n.strip() for n in name[len(OFFLOAD):].split(",") if n.strip())


def offloads(name: str) -> bool:
    """Whether the policy keeps activations in host memory."""
    return name == "offload_dots" or name.startswith(OFFLOAD)


def on_device(name: str) -> str:
    """The policy whose device-side activations `name` keeps: an offload policy keeps the
    layer's input there, as `full` does (its saved activations live in host memory)."""
    return "full" if offloads(name) else name


def recomputes(name: str) -> bool:
    """Whether the backward reruns the layer's forward (its collectives too)."""
    return name != "none"


def check(name: str) -> None:
    tags = offloaded_tags(name)
    unknown = [t for t in tags if t not in TAGS]
    if name.startswith(OFFLOAD) and (not tags or unknown or len(set(tags)) != len(tags)):
        what = f"unknown {', '.join(map(repr, unknown))}" if unknown else "no name, or one given twice"
        raise UserError(
            f"model.remat={name!r}: {what}. After offload: give a comma list of the activations to keep "
            f"in host memory, from {', '.join(TAGS)}, e.g. --config.model.remat=offload:qkv,mlp_up.")
    if name not in POLICIES and name != "offload_dots" and not tags:
        raise UserError(
            f"model.remat={name!r} is not a remat policy. Choose one of: "
            f"{', '.join(POLICIES)}, offload_dots, offload:NAMES (see meshtrain/models/remat.py).")


def policy(name: str):
    """The jax.checkpoint policy of `name` (checked)."""
    check(name)
    if name == "offload_dots":
        return jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", HOST)
    if name.startswith(OFFLOAD):
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=list(offloaded_tags(name)),
            offload_src="device", offload_dst=HOST)
    return POLICIES[name]


def wrap(fn: Callable, name: str, fetches: bool = False) -> Callable:
    """fn under the policy `name`; `fetches`: fn fetches its parameters from host memory
    (named FETCHED), which even `none` then recomputes rather than keeps."""
    if name == "none" and fetches:
        return jax.checkpoint(fn, policy=jax.checkpoint_policies.save_anything_except_these_names(FETCHED),
                              prevent_cse=False)
    rule = policy(name)
    return fn if name == "none" else jax.checkpoint(fn, policy=rule, prevent_cse=False)
