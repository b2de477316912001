"""One layout, planned: compile the real train step for the config's mesh from shapes
alone (no parameter memory), read its memory, collectives and FLOPs, set them beside the
formulas (planner/analytic.py) and predict the step on the named hardware
(planner/roofline.py).

    exp = Experiment.build(cfg)           # on simulated devices: mesh_lib.simulate_cpu_devices
    report = plan(exp, hardware.get("h100"))
    report["predicted_step_time_s"], report["collectives"]

The JSON keys are listed in docs/planner.md.
"""

from __future__ import annotations

import math
import time

import jax

from meshtrain.errors import mib
from meshtrain.planner import analytic, beyond_bounds, bounds as bounds_lib, hlo, hlo_flops, host_offload, roofline, \
    split_cost, work
from meshtrain.planner.hardware import Hardware
from meshtrain.runlog import metrics

MEMORY_KEYS = ("params", "optimizer", "gradients", "activations")


def compiled_memory(exp, compiled, formula: dict) -> dict[str, float]:
    """Per-device bytes of the compiled step: params and optimizer state from the shards of
    its input shardings; gradients at the parameters' compiled shardings (plus the
    microbatch accumulator of `formula`), since XLA reports them inside temp; activations
    and temporaries = temp - gradients; with XLA's totals."""
    ma = metrics.memory_report(compiled)
    state_shardings = compiled.input_shardings[0][0]
    abstract = exp.abstract_state()

    def shard_bytes(shapes, shardings) -> float:  # what the device holds between steps (not train.offload's)
        return float(sum(math.prod(sh.shard_shape(s.shape)) * s.dtype.itemsize
                         for s, sh in zip(jax.tree.leaves(shapes), jax.tree.leaves(shardings))
                         if s.shape and sh.memory_kind != "pinned_host"))
    params = shard_bytes(abstract.params, state_shardings.params)
    optimizer = shard_bytes(abstract.opt_state, state_shardings.opt_state)
    grads = params + formula["gradients"] - formula["params"]
    return {"params": params, "optimizer": optimizer, "gradients": grads,
            "activations": ma["temp"] - grads, "argument": ma["argument"], "output": ma["output"],
            "temp": ma["temp"], "alias": ma["alias"], "peak_estimate": ma["peak_estimate"],
            "total": ma["peak_estimate"]}


def _ratio(a, b):
    return None if a is None or not b else a / b


def plan(exp, hw: Hardware, compiled=None, compile_s: float | None = None) -> dict:
    """The planner's report for a built Experiment (docs/planner.md lists the keys)."""
    if compiled is None:
        t0 = time.perf_counter()
        compiled = exp.compile(analysis=True)
        compile_s = time.perf_counter() - t0
    cfg, mesh = exp.model.cfg, exp.mesh
    devices = mesh.devices.size
    node_of = roofline.node_of_position(mesh, hw.devices_per_node, exp.dcn)
    formula = analytic.memory(exp, hw)
    memory = compiled_memory(exp, compiled, formula)
    formula["total"] = sum(v or 0.0 for k, v in formula.items() if k in MEMORY_KEYS)
    rows = roofline.place(hlo.collective_table(compiled, mesh, node_of), mesh, node_of)
    bounds = roofline.place(bounds_lib.collective_bounds(exp), mesh, node_of)
    tokens = exp.units_per_step  # tokens, or images for a classifier
    model_flops = metrics.flops_per_unit(cfg) * tokens
    flops_dev = hlo_flops.dot_flops(compiled)
    # The formulas' activations: the CPU compiler's temp keeps float32 copies of bf16 values;
    # those the step writes, which under 1F1B are more than it keeps at once.
    traffic = {**memory, "activations": analytic.activation_traffic(exp, hw)}
    predicted = roofline.predict(hw, cfg.dtype, flops_dev, traffic, rows, model_flops, devices,
                                 work.step_work(exp, hw))
    pipe = analytic.pipeline_activations(exp, hw)
    fits = memory_fits(hw, formula, memory, cpu_activation_account(exp, hw))
    offload = host_offload.account(exp, analytic.state_bytes(exp), hw, analytic.offloaded_activations(exp))
    if offload is not None:  # the node's RAM must hold every device's offloaded share too
        fits["host_fits"] = offload["host_fits"]
        fits["fits"] = fits["fits"] and offload["host_fits"]
    return {
        "config": exp.cfg.to_dict(), "mesh": dict(mesh.shape), "dcn": exp.dcn, "layout": exp.layout.name,
        "model": exp.model.family.describe(cfg), "devices": devices, "hardware": hw.describe(),
        "attention": analytic.attention_on(exp, hw) if exp.model.family.task == "lm" else None,
        "pipeline": None if pipe is None else pipe.to_json(),
        "compile_time_s": compile_s,
        "memory_per_device_bytes": memory,
        "analytic_memory_per_device_bytes": formula,
        "memory_ratio": {k: _ratio(memory[k], formula[k]) for k in MEMORY_KEYS},
        "fits": fits,
        "offload": offload,
        "collectives": [_row(r) for r in rows],
        "collective_bounds": [_row(r) for r in bounds],
        "collective_bytes_per_step": sum(r["bytes"] for r in rows),
        "collective_lower_bound_bytes": sum(r["bytes"] for r in bounds),
        "collectives_by_axes": by_axes(rows, bounds, beyond_bounds.known_excess(exp), beyond_bounds.no_formula(exp)),
        **{name: split_cost.report(cost, exp, rows, compiled) for name, cost in bounds_lib.SPLIT_COSTS.items()},
        "flops_per_step": flops_dev * devices,
        "model_flops_per_step": model_flops,
        "flops_convention": (metrics.flops_convention(cfg) + "; flops_per_step: the compiled "
                             "program's matmul and conv FLOPs on all devices, loops counted (remat and the "
                             "full attention square included)"),
        "predicted_step_time_s": predicted["step_time_s"],
        "predicted_mfu": predicted["mfu"],
        "prediction": predicted,
    }


def memory_fits(hw: Hardware, formula: dict, memory: dict, cpu_account: dict | None = None) -> dict:
    """Whether the formulas' total fits the hardware's usable memory: the formula total
    decides, on the target hardware. The CPU compile's peak is no guide to an accelerator's
    (docs/planner.md, "Which memory figure decides"); `cpu_account` (`cpu_activation_account`)
    says how much of its activations the formulas explain."""
    usable = hw.hbm_bytes * hw.usable_memory
    return {"fits": formula["total"] <= usable, "decided_by": "analytic_total_bytes", "hardware": hw.name,
            "analytic_total_bytes": formula["total"], "usable_bytes": usable,
            "compiled_peak_estimate_bytes": memory["peak_estimate"],
            "compiled_activations_bytes": memory["activations"], "cpu_account": cpu_account or {}}


def cpu_activation_account(exp, hw: Hardware) -> dict:
    """The activation formula step by step from the target hardware to what the CPU
    compile runs: {"target": with the attention kernel the hardware takes, "xla_attention":
    with XLA's attention (the CPU compile's, which keeps [T, T] probabilities), "float32":
    that in float32, the width the CPU backend computes bf16 in}; {} without a formula."""
    target = analytic.activations(exp, hw)
    if target is None:
        return {}
    return {"target": target, "xla_attention": analytic.activations(exp, None),
            "float32": analytic.activations(exp, None, "float32")}


def _row(r: dict) -> dict:
    return {**r, "mesh_axes": list(r["mesh_axes"])}


def by_axes(rows: list[dict], bounds: list[dict], known: list[dict] = (), unbounded: list[dict] = ()) -> list[dict]:
    """Per mesh-axes group: compiled bytes, the lower bound, their ratio and the reasons for
    any excess (`known`: beyond_bounds.known_excess, then `excess` for what remains; a group in
    `unbounded`, beyond_bounds.no_formula, gives its `why` instead)."""
    keys = list(dict.fromkeys([tuple(r["mesh_axes"]) for r in bounds] + [tuple(r["mesh_axes"]) for r in rows]))
    out = []
    for axes in keys:
        mine = [r for r in rows if tuple(r["mesh_axes"]) == axes]
        bound = [r for r in bounds if tuple(r["mesh_axes"]) == axes]
        sent, least = sum(r["bytes"] for r in mine), sum(r["bytes"] for r in bound)
        reasons, explained = [], 0.0
        for k in known:
            if tuple(k["mesh_axes"]) == axes and sent > 1.02 * least:
                reasons.append(f"{k['kind']} {mib(k['bytes'])}: {k['why']}")
                explained += k["bytes"]
        rest = {r["kind"]: dict(r) for r in bound}
        for k in known:
            if tuple(k["mesh_axes"]) == axes and k["kind"] in rest:
                rest[k["kind"]]["bytes"] += k["bytes"]
        missing = [u["why"] for u in unbounded if tuple(u["mesh_axes"]) == axes]
        if sent > 1.02 * (least + explained):
            reasons += missing or excess(mine, list(rest.values()) if bound else [])
        out.append({"mesh_axes": list(axes), "bytes": sent, "lower_bound_bytes": least,
                    "ratio": _ratio(sent, least), "count": sum(r["count"] for r in mine),
                    "lower_bound_count": sum(r["count"] for r in bound), "excess": reasons})
    return out


def excess(rows: list[dict], bounds: list[dict]) -> list[str]:
    """Why one axis group sends more than its bound: each op kind compared with the bound's."""
    reasons = []
    axes = "+".join((rows or bounds)[0]["mesh_axes"]) if (rows or bounds) else ""
    sent, least = sum(r["bytes"] for r in rows), sum(r["bytes"] for r in bounds)
    if least and sent <= 1.02 * least:
        return reasons
    mine = {r["kind"]: r for r in rows}
    theirs = {r["kind"]: r for r in bounds}
    if not bounds:
        return [f"the layout needs no traffic over {axes}, but the program sends "
                + ", ".join(f"{r['kind']} x{r['count']} ({mib(r['bytes'])})" for r in rows)
                + ": an activation changes sharding there (a constraint that disagrees with its "
                  "neighbour, or a dimension that does not divide)"]
    for kind, r in mine.items():
        b = theirs.get(kind)
        amount = mib(r["bytes"])
        if kind == "all-reduce" and "reduce-scatter" in theirs and (b is None or r["bytes"] > 2 * b["bytes"]):
            reasons.append(f"gradients reduced by all-reduce ({amount}) where the bound reduce-"
                           f"scatters: an all-reduce sends twice a reduce-scatter's bytes and leaves "
                           f"the full gradient on every device (the CPU compiler's choice here; check "
                           f"the accelerator's HLO)")
        elif b is None and "stage" in r["mesh_axes"]:
            reasons.append(f"{kind} x{r['count']} ({amount}): the pipeline's inputs enter the "
                           f"first stage and its finished outputs leave the last, between the batch "
                           f"split over stage outside the pipeline and the stage-sharded buffers")
        elif b is None:
            reasons.append(f"{kind} x{r['count']} ({amount}) outside the bound: resharding of "
                           f"an activation or a gradient between two layouts")
        elif r["bytes"] > 1.02 * b["bytes"]:
            reasons.append(_kind_excess(kind, r, b))
    return reasons


def _kind_excess(kind: str, r: dict, b: dict) -> str:
    ratio = r["bytes"] / b["bytes"]
    head = f"{kind}: {r['count']} ops, {mib(r['bytes'])} against {b['count']}, {mib(b['bytes'])} ({ratio:.2f}x)"
    if kind == "all-gather":
        return head + ": weights gathered once more per layer where remat recomputes the forward, " \
                      "norm scales and biases gathered in float32, or activations regathered"
    if kind == "collective-permute" and "stage" in r["mesh_axes"]:
        return head + ": the stage buffer rolls on every tick, the bubble ticks included, and as a " \
                      "ring: the last stage sends too"
    if kind == "collective-permute":
        return head + ": halo rows beyond the formula's: a pool whose windows straddle a split " \
                      "boundary (an odd local height), or a conv's rows fetched more than once"
    if b["count"] and r["count"] > b["count"]:
        return head + f": {r['count'] - b['count']} ops more than the bound (remat recomputes the " \
                      "forward's, the loss reduces over the split vocabulary, or a gradient is " \
                      "reduced in pieces)"
    if kind == "all-reduce" and "stage" in r["mesh_axes"] and len(r["mesh_axes"]) > 1 and ratio > 2:
        return head + ": the gradients of the tables split over stage (embedding, head) all-reduced " \
                      "whole over the batch axes, then sliced, where the bound reduce-scatters them over " \
                      "stage and reduces 1/S over the rest (the CPU compiler's choice here; check the " \
                      "accelerator's HLO)"
    return head + ": some of it in float32 where the bound assumes the compute dtype (e.g. norm " \
                  "and bias gradients computed in float32, or a float32 table)"
