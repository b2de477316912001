"""What train.offload buys and costs, by the formulas (parallel/offload.py does it).

Per device, with P, O and G the params', optimizer state's and gradients' bytes
(planner/analytic.py's state_bytes), s the share of each in the stack of L layers:

  on the device   params     P (1 - s) + 2 P s / L under params offload: the rest (embeddings,
                             final norm) and two layers, the one running and the next arriving
                  gradients  likewise under params offload (each layer's leaves for the host),
                             but with microbatches their float32 sum stays on the device, whole
                  optimizer  O (1 - s) + O s / L under opt_state offload: the rest and the one
                             layer the streamed update holds (all of O under a pipeline, whose
                             update takes it whole)
  in host memory  P and G s under params offload, O under opt_state offload; every device a
                  node drives keeps its share in the node's RAM (hardware.host_memory_bytes)
  over the link   host to device: O (the update reads it); 2 P + P s (the forward reads
                  every layer, the backward the stack again, the update all once more) and
                  2 G s (the gradient norm and the update read the stack's gradients)
                  device to host: O (written back); P (written back) and G s (the backward
                  writes the stack's gradients)
  link time       the busier direction / (host_link_bandwidth x host_link_efficiency): the
                  link is full duplex; XLA overlaps transfers with compute where the
                  schedule lets it, so the plan shows it beside the step, not added to it

Activation offload (model.remat=offload_*): the device keeps what `full` keeps (each layer's
input; planner/analytic.py asks the family at models/remat.on_device's policy), the host
every layer's tagged activations (analytic.offloaded_activations: Family.tagged_elements
per token), written over the link in the forward and read back in the backward.
"""

from __future__ import annotations

import math

from meshtrain.models import remat
from meshtrain.parallel import offload as offload_lib
from meshtrain.run.memory_budget import MARGIN  # the share of a host's RAM a run may take

KEYS = ("params", "optimizer", "gradients")


def device_shares(exp, state: dict) -> dict[str, float]:
    """{params, optimizer, gradients}: the bytes each keeps on the device (docstring)."""
    off, m = offload_lib.Offload.of(exp.cfg.train), exp.model
    out = {k: state[k] for k in KEYS}
    if not off or m.stacked is None:
        return out
    layers, s = m.cfg.num_layers, state["stacked"]

    def keep(key, held):
        return state[key] * ((1 - s[key]) + s[key] * held / layers)
    if off.params:
        out["params"] = keep("params", 2)
        if exp.cfg.train.grad_accum_steps == 1:  # else the microbatches' sum is on the device, whole
            out["gradients"] = keep("gradients", 2)
    if off.opt_state and m.pipeline is None:
        out["optimizer"] = keep("optimizer", 1)
    return out


def account(exp, state: dict, hw, activations: float | None = 0.0) -> dict | None:
    """What offload moves per device: host bytes, link bytes each way and their time on
    `hw`, and whether the node's RAM holds every device's share; None without offload.
    `activations`: the bytes model.remat=offload_* keeps in host memory (analytic's
    offloaded_activations; None: not counted), written in the forward, read in the backward."""
    off = offload_lib.Offload.of(exp.cfg.train)
    if not off and not remat.offloads(exp.model.cfg.remat):
        return None
    s = state["stacked"]
    p, o, g = state["params"], state["optimizer"], state["gradients"] * s["gradients"]
    a = activations or 0.0
    host = (p + g if off.params else 0.0) + (o if off.opt_state else 0.0) + a
    to_device = (o if off.opt_state else 0.0) + (2 * p + p * s["params"] + 2 * g if off.params else 0.0) + a
    to_host = (o if off.opt_state else 0.0) + (p + g if off.params else 0.0) + a
    rate = hw.host_link_bandwidth * hw.host_link_efficiency
    node = host * min(math.prod(exp.mesh.shape.values()), hw.devices_per_node)  # the run's devices on a node
    return {"offload": list(off.names), "remat": exp.model.cfg.remat, "activation_bytes": activations,
            "host_bytes": host, "node_host_bytes": node,
            "host_memory_bytes": hw.host_memory_bytes, "host_fits": node <= MARGIN["cpu"] * hw.host_memory_bytes,
            "to_device_bytes": to_device, "to_host_bytes": to_host,
            "link_bandwidth": hw.host_link_bandwidth, "link_s": max(to_device, to_host) / rate}
