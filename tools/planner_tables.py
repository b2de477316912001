"""The planner's own tables in docs/planner.md (registered in tools/docs_tables.py).

    hardware_table()    the hardware entries, as the roofline reads them
    ring_table()        what a ring across nodes moves at, by how it sits on the nodes
    survey_table()      GPT-2 medium on 16-way tensor parallelism over 2 DGX A100 nodes,
                        the predicted communication share beside the survey's measured one
    acceptance_table()  the two acceptance configs, compiled on simulated devices

Each returns markdown. The compiled ones run in the generator's process, which simulates
docs_tables.SIMULATED_DEVICES CPU devices.
"""

from __future__ import annotations

import dataclasses

from meshtrain.planner import hardware, roofline

# Nichols et al., "A Survey and Empirical Evaluation of Parallel Deep Learning Frameworks"
# (arXiv 2111.04949): Megatron on GPT-2 medium, 16 GPUs, the share of its step spent in
# communication (the figure the brief of this table quotes; see docs/planner.md for what
# is assumed about the setup).
SURVEY_SHARE = 0.525
SURVEY_OVERRIDES = [("mesh.shape", "tensor:16"), ("mesh.dcn", "tensor:2"), ("layout", "tp"),
                    ("model.seq_len", "1024"), ("model.dtype", "bfloat16")]
SURVEY_BATCHES = (8, 64)
SURVEY_HARDWARE = "a100_40gb"


def _table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def hardware_table() -> str:
    rows = []
    for hw in hardware.TABLE.values():
        rows.append([f"`{hw.name}`", f"{hw.peak('bfloat16') / 1e12:,.0f}", f"{hw.hbm_bytes / 1e9:,.0f}",
                     f"{hw.hbm_bandwidth / 1e12:.2f}", str(hw.devices_per_node), f"{hw.link_bandwidth / 1e9:,.0f}",
                     f"{hw.nics} x {hw.network_bandwidth * 8 / 1e9:,.0f} Gb/s",
                     f"{hw.node_network_bandwidth / 1e9:,.0f}", f"{hw.matmul_efficiency:.3f}",
                     ", ".join(f"{k}: {v:.3g}" for k, v in sorted(hw.attention_efficiency.items())),
                     f"{hw.elementwise_efficiency:.3f}", f"{hw.idle_share:.4f}", f"{hw.link_efficiency:.2f}",
                     "measured" if hw.calibration.startswith("matmul") else "assumed"])
    return _table(["entry", "bf16 TFLOP/s", "HBM GB", "HBM TB/s", "GPUs a node", "NVLink GB/s one way",
                   "compute NICs a node", "node network GB/s", "matmul_efficiency", "attention_efficiency",
                   "elementwise_efficiency", "idle_share", "link_efficiency", "compute figures"], rows)


# (what, collective kind, nodes k, devices of a group in a node m, groups in a node c)
RING_CASES = [
    ("data over 4 nodes, tensor 8 inside each", "all-reduce", 4, 1, 8),
    ("data 8 x tensor 4 on 4 nodes in device order (data groups of 2 a node)", "all-reduce", 4, 2, 4),
    ("fsdp 32 over 4 nodes", "all-gather", 4, 8, 1),
    ("fsdp 32 over 4 nodes", "all-reduce", 4, 8, 1),
    ("tensor 16 over 2 nodes (the survey's point)", "all-reduce", 2, 8, 1),
]


def ring_table() -> str:
    """GB/s at which one device's ring bytes move (before link_efficiency, no latency)."""
    rows = []
    for name in ("h100", "a100"):
        hw = dataclasses.replace(hardware.TABLE[name], link_efficiency=1.0, network_latency_s=0.0)
        for what, kind, k, m, c in RING_CASES:
            n = k * m
            wire = 2 * (n - 1) / n if kind == "all-reduce" else (n - 1) / n
            row = {"kind": kind, "count": 0, "bytes": wire * 1e9, "crosses_nodes": True, "nodes": k,
                   "per_node": m, "groups_per_node": c, "group_size": n}
            ring = roofline.ring_bandwidth(hw, c)
            used = row["bytes"] / roofline.collective_seconds(hw, row)
            two = "-"
            if kind == "all-reduce" and m > 1:
                t2 = 2 * (m - 1) / m / hw.link_bandwidth + c * 2 * (k - 1) / k / hw.node_network_bandwidth
                two = f"{wire / t2 / 1e9:,.0f}"
            rows.append([f"`{name}`", what, kind, f"{k}, {m}, {c}", f"{ring / 1e9:,.0f}", two, f"{used / 1e9:,.0f}",
                         f"{hw.network_bandwidth / 1e9:,.0f}"])
    return _table(["hardware", "group", "kind", "k, m, c", "flat ring GB/s", "two-level GB/s", "charged GB/s",
                   "one NIC a ring (before NICs per node), GB/s"], rows)


def _report(name: str, overrides: list, hw) -> dict:
    """A compiled report of config `name` with `overrides`, on this process's devices."""
    import math

    import jax

    from meshtrain import config as config_lib, mesh as mesh_lib
    from meshtrain.planner import accumulation, report as report_lib
    from meshtrain.run.experiment import Experiment, read_inputs, resolve
    cfg = config_lib.load(name)
    for key, value in overrides:
        config_lib.override(cfg, key, value)
    n = math.prod(mesh_lib.parse_shape(cfg.mesh.shape).values())
    inputs = read_inputs(cfg)
    exp = Experiment.build(resolve(cfg, inputs.init), devices=jax.devices()[:n], inputs=inputs,
                           choose_gather=accumulation.for_hardware(hw))  # as `meshtrain plan`
    return report_lib.plan(exp, hw)


def one_nic_prediction(r: dict, hw) -> dict:
    """The report's prediction with every row across nodes charged as before NICs per node:
    a flat ring on one NIC's bandwidth (rows without placement, roofline.collective_seconds)."""
    placed = ("nodes", "per_node", "groups_per_node", "group_size")
    rows = [{k: v for k, v in row.items() if k not in placed} for row in r["collectives"]]
    memory = {**r["memory_per_device_bytes"], "activations": r["analytic_memory_per_device_bytes"]["activations"]}
    hw = dataclasses.replace(hw, nics_per_node=hw.devices_per_node)
    return roofline.predict(hw, r["config"]["model"]["dtype"], r["flops_per_step"] / r["devices"], memory, rows,
                            r["model_flops_per_step"], r["devices"], r["prediction"]["work"])


def survey_reports() -> list[tuple[int, dict]]:
    hw = hardware.TABLE[SURVEY_HARDWARE]
    return [(b, _report("gpt2_medium_dp8_tp4", SURVEY_OVERRIDES + [("train.batch_size", str(b))], hw))
            for b in SURVEY_BATCHES]


def survey_table() -> str:
    hw = hardware.TABLE[SURVEY_HARDWARE]
    rows = []
    for b, r in survey_reports():
        p = r["prediction"]
        old = one_nic_prediction(r, hw)
        slow = roofline.predict(dataclasses.replace(hw, matmul_efficiency=0.4), "bfloat16",
                                r["flops_per_step"] / r["devices"],
                                {**r["memory_per_device_bytes"],
                                 "activations": r["analytic_memory_per_device_bytes"]["activations"]},
                                r["collectives"], r["model_flops_per_step"], r["devices"], p["work"])
        rows.append([str(b), f"{1e3 * p['step_time_s']:,.1f}", f"{1e3 * p['matmul_s']:,.1f}",
                     f"{1e3 * p['memory_s']:,.1f}", f"{1e3 * p['exposed_collectives_s']:,.1f}",
                     f"**{100 * roofline.communication_share(p):.1f}%**",
                     f"{100 * roofline.communication_share(old):.1f}%",
                     f"{100 * roofline.communication_share(slow):.1f}%", f"{100 * SURVEY_SHARE:.1f}%"])
    return _table(["batch (sequences)", "step ms", "matmuls ms", "memory ms", "tensor all-reduces ms",
                   "communication, predicted", "before the NIC fix (one NIC a ring)",
                   "predicted, matmuls at 40% of peak", "survey, measured"], rows)


ACCEPTANCE = ("gpt2_medium_dp8_tp4", "llama3_8b_fsdp8_tp4")


def acceptance_table() -> str:
    hw = hardware.TABLE["h100"]
    rows = []
    for name in ACCEPTANCE:
        r = _report(name, [], hw)
        mem, formula, p = r["memory_per_device_bytes"], r["analytic_memory_per_device_bytes"], r["prediction"]
        axes = "; ".join(f"{'+'.join(a['mesh_axes'])} {a['bytes'] / 2**20:,.1f} / {a['lower_bound_bytes'] / 2**20:,.1f}"
                         for a in r["collectives_by_axes"])
        rows.append([f"`{name}`", str(r["devices"]),
                     f"{(mem['params'] + mem['optimizer']) / 2**20:,.1f} / "
                     f"{(formula['params'] + formula['optimizer']) / 2**20:,.1f}",
                     f"{formula['total'] / 2**30:,.2f}", axes,
                     f"{r['flops_per_step'] / r['model_flops_per_step']:.3f}x",
                     f"{1e3 * p['step_time_s']:,.1f}", f"{100 * p['mfu']:.1f}%", p["bound_by"]])
    return _table(["config", "devices", "params + optimizer MiB, compiled / formula", "formula total GiB",
                   "collectives MiB sent / bound, per mesh axes", "FLOPs compiled / model",
                   "predicted step ms (h100)", "MFU", "bound by"], rows)
