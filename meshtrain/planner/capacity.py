"""The question users ask before renting: how large a model trains on these devices, with
and without host offload? (`meshtrain plan --config=NAME --largest`)

At the config's width, mesh, layout, batch and remat, the most layers whose formula total
(planner/analytic.py, the device's share under train.offload: planner/host_offload.py)
fits the hardware's usable memory, and whose offloaded state fits its node's RAM; found
by bisection on model.num_layers (the formulas grow with it), by the formulas alone:
nothing is compiled or allocated, so a 70B plan runs on a laptop.
"""

from __future__ import annotations

import copy
import dataclasses

from meshtrain import config as config_lib, mesh as mesh_lib
from meshtrain.errors import UserError
from meshtrain.planner import analytic, host_offload

SETTINGS = ("none", "opt_state", "opt_state,params")
MAX_LAYERS = 4096


@dataclasses.dataclass(frozen=True)
class Fit:
    offload: str
    layers: int          # 0: not even one layer fits
    params: int          # the model's parameters at that depth
    device_bytes: float  # the formula total per device
    host_bytes: float    # offloaded per device
    link_s: float        # the host link's busier direction per step (planner/host_offload.py)
    limit: str = ""      # what one more layer would not fit: "device memory" or "host memory"


def evaluate(cfg, hw, layers: int, offload: str) -> tuple[bool, Fit]:
    """Whether `cfg` with `layers` layers and train.offload=`offload` fits `hw`."""
    c = copy.deepcopy(cfg)
    config_lib.override(c, "model.num_layers", str(layers))
    config_lib.override(c, "train.offload", offload)
    exp = analytic.abstract_experiment(c)
    device = sum(v or 0.0 for v in analytic.memory(exp, hw).values())
    account = host_offload.account(exp, analytic.state_bytes(exp), hw, analytic.offloaded_activations(exp))
    on_device = device <= hw.hbm_bytes * hw.usable_memory
    on_host = account is None or account["host_fits"]
    return on_device and on_host, Fit(offload, layers, exp.model.family.num_params(exp.model.cfg), device,
                                      0.0 if account is None else account["host_bytes"],
                                      0.0 if account is None else account["link_s"],
                                      "device memory" if not on_device else "" if on_host else "host memory")


def largest(cfg, hw, settings=SETTINGS) -> list[Fit]:
    """The deepest fitting model per offload setting (layers in multiples of the stages)."""
    stages = mesh_lib.parse_shape(cfg.mesh.shape)["stage"]
    step = stages * max(cfg.pipeline.repeats, 1) if stages > 1 else 1
    out = []
    for offload in settings:
        try:
            ok, fit = evaluate(cfg, hw, step, offload)
        except UserError:  # e.g. params offload under a pipeline: not a setting for this config
            continue
        if not ok:
            out.append(dataclasses.replace(fit, layers=0, params=0))
            continue
        lo, hi = 1, MAX_LAYERS // step  # in units of `step`: lo fits, above hi is not tried
        while lo < hi:
            mid = (lo + hi + 1) // 2
            ok, found = evaluate(cfg, hw, mid * step, offload)
            lo, hi, fit = (mid, hi, found) if ok else (lo, mid - 1, fit)
        limit = (evaluate(cfg, hw, (lo + 1) * step, offload)[1].limit if lo < MAX_LAYERS // step
                 else f"the search's {MAX_LAYERS} layers")
        out.append(dataclasses.replace(fit, limit=limit))
    return out
