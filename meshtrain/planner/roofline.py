"""Predicted step time: a roofline over matmuls, memory traffic and collectives.

    matmul    FLOPs one device runs / (peak for the compute dtype x matmul efficiency)
    memory    HBM bytes / HBM bandwidth, with the bytes counted coarsely: the optimizer
              update reads params, gradients and both moments and writes params and
              moments; activations are written forward, read backward and passed over
              once more by the element-wise kernels (3 x the activation bytes)
    links     per collective group: bytes sent / (bandwidth x link efficiency) + a latency
              per op, over NVLink when the group stays inside a node and over the network
              when it spans nodes (mesh.dcn, or the mesh's device order in nodes of
              `devices_per_node`)
    overlap   gradient reductions and FSDP gathers (data, fsdp axes) run beside compute
              (XLA's latency-hiding scheduler); tensor and stage collectives sit between
              dependent matmuls and add to the step
    step      max(matmul + memory, overlapped collectives) + exposed collectives

The pipeline bubble needs no term of its own: the compiled FLOPs count the bubble ticks'
work, which the schedule runs whether or not it is useful.
"""

from __future__ import annotations

import math

from meshtrain import mesh as mesh_lib
from meshtrain.cluster import distributed
from meshtrain.planner.hardware import Hardware

EXPOSED_AXES = ("tensor", "stage")


def node_of_position(mesh, devices_per_node: int, dcn: dict | None):
    """-> f(device) = its node: under mesh.dcn the node `mesh.nodes_of` gives it (the
    granules `make_mesh` placed the DCN factors over), else contiguous blocks of
    `devices_per_node` in the mesh's device order (how a cluster's processes fill it)."""
    flat = list(mesh.devices.flatten())
    if dcn:
        node, _ = mesh_lib.nodes_of(sorted(flat, key=lambda d: d.id), dcn, distributed.hosts())
        return lambda d: node[d.id]
    index = {d.id: i for i, d in enumerate(flat)}
    return lambda d: index[d.id] // devices_per_node


def crosses_nodes(mesh, axes: tuple[str, ...], node_of) -> bool:
    """Whether a group along `axes` (the other coordinates fixed) spans several nodes."""
    devices = mesh.devices
    moved = [mesh.axis_names.index(a) for a in axes]
    rest = [k for k in range(devices.ndim) if k not in moved]
    groups = devices.transpose(rest + moved).reshape(-1, math.prod(devices.shape[k] for k in moved))
    return any(len({node_of(d) for d in g}) > 1 for g in groups)


def collective_seconds(hw: Hardware, row: dict, crosses: bool) -> float:
    bandwidth, latency = ((hw.network_bandwidth, hw.network_latency_s) if crosses
                          else (hw.link_bandwidth, hw.link_latency_s))
    return row["bytes"] / (bandwidth * hw.link_efficiency) + row["count"] * latency


def predict(hw: Hardware, dtype: str, flops_per_device: float, memory: dict, collectives: list[dict],
            model_flops_per_step: float, devices: int) -> dict:
    """`memory`: per-device bytes {params, optimizer, gradients, activations}; `collectives`:
    rows {kind, mesh_axes, count, bytes, crosses_nodes}. -> the terms in seconds, the step
    time and the MFU it implies."""
    matmul = flops_per_device / (hw.peak(dtype) * hw.matmul_efficiency)
    state = 2 * memory["params"] + 2 * memory["optimizer"] + memory["gradients"]
    traffic = state + 3 * (memory.get("activations") or 0.0)
    hbm = traffic / hw.hbm_bandwidth
    exposed = overlapped = 0.0
    by_axes: dict[str, float] = {}
    for row in collectives:
        seconds = collective_seconds(hw, row, row.get("crosses_nodes", False))
        key = "+".join(row["mesh_axes"]) or "none"
        by_axes[key] = by_axes.get(key, 0.0) + seconds
        if any(a in EXPOSED_AXES for a in row["mesh_axes"]):
            exposed += seconds
        else:
            overlapped += seconds
    step = max(matmul + hbm, overlapped) + exposed
    return {"step_time_s": step, "mfu": model_flops_per_step / (devices * hw.peak(dtype) * step),
            "matmul_s": matmul, "memory_s": hbm, "exposed_collectives_s": exposed,
            "overlapped_collectives_s": overlapped, "collectives_s_by_axes": by_axes,
            "bound_by": _bound_by(matmul, hbm, overlapped, exposed)}


def _bound_by(matmul: float, hbm: float, overlapped: float, exposed: float) -> str:
    if overlapped > matmul + hbm:
        return "gradient and weight traffic (data/fsdp links)"
    terms = {"matmuls": matmul, "memory bandwidth": hbm, "tensor/stage collectives": exposed}
    return max(terms, key=terms.get)
