"""Predicted step time: a roofline over matmuls, attention, memory traffic and collectives
(docs/planner.md, "Predicted step", says where each term comes from).

    matmul    (matmul FLOPs a device runs - a flash kernel's attention) / (peak x matmul_efficiency)
    attention with cuDNN: the causal half of the attention FLOPs / (peak x
              attention_efficiency at the head width); XLA's attention is matmuls
    memory    (2 params + 2 optimizer + gradients + planner/work.py's loss and layer bytes)
              / (HBM bandwidth x elementwise_efficiency); without an activation formula,
              3 x the activations at the full bandwidth instead
    idle      idle_share x the busy time
    links     per collective group: bytes / (bandwidth x link_efficiency) + latency x ops,
              over NVLink inside a node, across nodes by `collective_seconds`
    step      max(matmul + attention + memory, data/fsdp collectives) + idle
              + tensor/stage/expert collectives (they wait between dependent matmuls)

The efficiencies are planner/hardware.py's; `calibration` in the result says which are
measured. The pipeline bubble needs no term: the compiled FLOPs count the bubble ticks.
"""

from __future__ import annotations

import math

from meshtrain import mesh as mesh_lib
from meshtrain.cluster import distributed
from meshtrain.planner.hardware import Hardware

EXPOSED_AXES = ("tensor", "stage", "expert")
FUSED_ATTENTION = ("cudnn",)  # kernels that skip the masked half and keep no [T, T] probabilities


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


def placement(mesh, axes: tuple[str, ...], node_of) -> dict:
    """How the groups along `axes` sit on nodes: {"crosses_nodes", "nodes": the most nodes
    one group spans (k), "per_node": the most of one group's devices in a node (m),
    "groups_per_node": the most groups with devices in one node (c: they run the same
    collective at once and share the node's NICs), "group_size": n}."""
    devices = mesh.devices
    moved = [mesh.axis_names.index(a) for a in axes]
    rest = [k for k in range(devices.ndim) if k not in moved]
    n = math.prod(devices.shape[k] for k in moved)
    groups = devices.transpose(rest + moved).reshape(-1, n)
    k = m = 1
    touching: dict = {}
    for i, g in enumerate(groups):
        nodes = [node_of(d) for d in g]
        k = max(k, len(set(nodes)))
        m = max(m, max(nodes.count(x) for x in set(nodes)))
        for x in set(nodes):
            touching.setdefault(x, set()).add(i)
    c = max((len(v) for v in touching.values()), default=1)
    return {"crosses_nodes": k > 1, "nodes": k, "per_node": m, "groups_per_node": c, "group_size": n}


def place(rows: list[dict], mesh, node_of) -> list[dict]:
    """Adds `placement` to each collective row, in place; returns the rows."""
    cache: dict = {}
    for r in rows:
        axes = tuple(r["mesh_axes"])
        if axes not in cache:
            cache[axes] = placement(mesh, axes, node_of)
        touched = r.get("nodes")  # a compiled row's (hlo.collective_table): the most nodes a group touches
        r.update(cache[axes])
        if r.get("in_node") or touched == 1:  # groups cut inside a node (bounds' in-node rows, or compiled)
            r.update(crosses_nodes=False, nodes=1)
        elif r.get("across") and r["crosses_nodes"]:  # one position a node: the axis's m groups share its NICs
            r.update(per_node=1, groups_per_node=r["per_node"] * r["groups_per_node"], group_size=r["nodes"])
    return rows


def ring_bandwidth(hw: Hardware, groups_per_node: int) -> float:
    """bytes/s (before link_efficiency) at which a flat ring across nodes moves one device's
    ring bytes: its node's NICs shared by the `groups_per_node` rings crossing it, at most
    NVLink. With r rings (NCCL channels) each leaving a node once through its own NIC,
    every ring byte a device sends crosses the node boundary once per ring: the node's
    egress per group equals one device's ring bytes (docs/planner.md, "Across nodes")."""
    return min(hw.link_bandwidth, hw.node_network_bandwidth / max(groups_per_node, 1))


def collective_seconds(hw: Hardware, row: dict, crosses: bool | None = None) -> float:
    """One row's time: in a node, bytes / NVLink; across nodes the faster of a flat ring
    (`ring_bandwidth`) and, for all-reduce, the two-level algorithm: reduce-scatter over
    the m devices in each node (NVLink), all-reduce of the 1/m pieces over the k nodes
    (the node's NICs, shared by its c groups), all-gather in the node. A row without
    placement (`place`) that crosses is taken as one device per node, each group on its
    share of the node's NICs."""
    crosses = row.get("crosses_nodes", False) if crosses is None else crosses
    eff = hw.link_efficiency
    if not crosses:
        return row["bytes"] / (hw.link_bandwidth * eff) + row["count"] * hw.link_latency_s
    m = row.get("per_node", 1)
    c = row.get("groups_per_node", max(hw.devices_per_node // m, 1))
    seconds = row["bytes"] / (ring_bandwidth(hw, c) * eff)
    k, n = row.get("nodes", 2), row.get("group_size", 0)
    if row["kind"] == "all-reduce" and m > 1 and k > 1 and n > 1:
        full = row["bytes"] / (2 * (n - 1) / n)  # S, the reduced array's bytes
        two_level = (2 * (m - 1) / m * full / (hw.link_bandwidth * eff)
                     + c * 2 * (k - 1) / k * full / (hw.node_network_bandwidth * eff))
        seconds = min(seconds, two_level)
    return seconds + row["count"] * hw.network_latency_s


def predict(hw: Hardware, dtype: str, flops_per_device: float, memory: dict, collectives: list[dict],
            model_flops_per_step: float, devices: int, work: dict | None = None) -> dict:
    """`memory`: per-device bytes {params, optimizer, gradients, activations}; `collectives`:
    rows {kind, mesh_axes, count, bytes, crosses_nodes}; `work`: planner/work.py's
    step_work, or None (then the coarse memory term of the module docstring). -> the terms
    in seconds, the step time and the MFU it implies, and which terms were measured."""
    matmul_flops, attention = flops_per_device, 0.0
    state = 2 * memory["params"] + 2 * memory["optimizer"] + memory["gradients"]
    if work is None:
        traffic = state + 3 * (memory.get("activations") or 0.0)
        hbm = traffic / hw.hbm_bandwidth
    else:
        if work["attention_kernel"] in FUSED_ATTENTION:
            # A flash kernel runs the causal half of the square the compiled program counts.
            matmul_flops = max(flops_per_device - work["attention_flops"], 0.0)
            attention = work["attention_flops"] / 2 / (hw.peak(dtype) * hw.attention_efficiency_at(work["head_dim"]))
        traffic = state + work["loss_bytes"] + work["layer_bytes"]
        hbm = traffic / (hw.hbm_bandwidth * hw.elementwise_efficiency)
    matmul = matmul_flops / (hw.peak(dtype) * hw.matmul_efficiency)
    exposed = overlapped = 0.0
    by_axes: dict[str, float] = {}
    for row in collectives:
        seconds = collective_seconds(hw, row)
        key = "+".join(row["mesh_axes"]) or "none"
        by_axes[key] = by_axes.get(key, 0.0) + seconds
        if any(a in EXPOSED_AXES for a in row["mesh_axes"]):
            exposed += seconds
        else:
            overlapped += seconds
    busy = matmul + attention + hbm
    idle = (busy * hw.idle_share) if work is not None else 0.0
    step = max(busy, overlapped) + idle + exposed
    return {"step_time_s": step, "mfu": model_flops_per_step / (devices * hw.peak(dtype) * step),
            "matmul_s": matmul, "attention_s": attention, "memory_s": hbm, "idle_s": idle,
            "exposed_collectives_s": exposed, "overlapped_collectives_s": overlapped,
            "collectives_s_by_axes": by_axes, "memory_bytes": traffic, "work": work,
            "bound_by": _bound_by(matmul + attention, hbm, overlapped, exposed),
            "calibration": hw.calibration if work is not None else "none: the coarse memory term, no attention or idle terms"}


def _bound_by(matmul: float, hbm: float, overlapped: float, exposed: float) -> str:
    if overlapped > matmul + hbm:
        return "gradient and weight traffic (data/fsdp links)"
    terms = {"matmuls": matmul, "memory bandwidth": hbm, "tensor/stage collectives": exposed}
    return max(terms, key=terms.get)


def communication_share(p: dict) -> float:
    """The share of a predicted step (`predict`'s dict) spent communicating: the exposed
    collectives, and the overlapped ones where they outlast the compute they hide behind."""
    hidden_behind = p["matmul_s"] + p.get("attention_s", 0.0) + p["memory_s"]
    return (p["exposed_collectives_s"] + max(0.0, p["overlapped_collectives_s"] - hidden_behind)) / p["step_time_s"]
