"""The planner's reports as text for a terminal (`python -m meshtrain.plan` without --json):
`render` one config's plan (planner/report.py), `largest` the deepest model that fits
(planner/capacity.py), `table` columns aligned (the search's ranking too)."""

from __future__ import annotations

import math

from meshtrain import mesh as mesh_lib
from meshtrain.errors import GiB, MiB, gib, mib
from meshtrain.planner.report import MEMORY_KEYS


def _mib(x) -> str:
    """A table cell: MiB to a tenth, without the unit (the column's header says it)."""
    return "-" if x is None else f"{x / MiB:,.1f}"


def _ratio(x) -> str:
    return "-" if x is None else f"{x:.2f}x"


def table(rows: list[list[str]], right: set[int] = frozenset()) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in
                             enumerate(zip(r, widths))).rstrip() for r in rows]


def fit_lines(fit: dict, mem: dict) -> list[str]:
    """Which memory figure decides fitting (the formula total, on the target hardware), and
    why the CPU compile's differs: the formulas' activations step by step towards what the
    CPU compile runs, each step shown only where it changes the figure."""
    verdict = "fits" if fit["fits"] else "DOES NOT FIT"
    hw = fit.get("hardware", "the hardware")
    lines = [f"  {verdict} on {hw}: decided by the formula total, {fit['analytic_total_bytes'] / GiB:,.2f} GiB "
             f"of {fit['usable_bytes'] / GiB:,.1f} GiB usable",
             f"  the CPU compile's total ({fit['compiled_peak_estimate_bytes'] / GiB:,.2f} GiB) does not decide: "
             f"it is the CPU backend's buffer assignment, not {hw}'s"]
    account = fit.get("cpu_account") or {}
    if account:
        lines.append(f"  its activations, {_mib(mem['activations'])} MiB, against the formulas':")
        lines.append(f"    {_mib(account['target']):>10} MiB with the attention kernel {hw} takes")
        if account["xla_attention"] != account["target"]:
            lines.append(f"    {_mib(account['xla_attention']):>10} MiB with XLA's attention, which the CPU compile "
                         f"runs ([T, T] probabilities kept)")
        if account["float32"] != account["xla_attention"]:
            lines.append(f"    {_mib(account['float32']):>10} MiB with that in float32, the width the CPU backend "
                         f"computes bf16 in")
        lines.append("    the rest is the CPU backend's buffer assignment (XLA's attention keeps more [T, T] tensors "
                     "than the formula counts); a GPU compile also fuses more and rematerialises a program that "
                     "would exceed its memory (docs/planner.md, \"Which memory figure decides\")")
    else:
        lines.append(f"  no activation formula for this model (Family.layer_activation_bytes): its "
                     f"{_mib(mem['activations'])} MiB are the CPU compile's alone")
    return lines


def pipeline_lines(p: dict) -> list[str]:
    """The schedule, the items stage 0 keeps and the activation formula's parts."""
    how = p["schedule"] + (f" (v={p['repeats']})" if p["repeats"] > 1 else "")
    how += f", stash={p['stash']}" if p["stash"] else ""
    kept = p["items_kept_per_stage"]
    parts = ", ".join(f"{k} {_mib(v)}" for k, v in p["activation_parts_bytes"].items() if v)
    room = f", stash room for {p['stash_slots']}" if p["stash"] else ""
    return [f"  pipeline {how}: S={p['stages']}, M={p['microbatches']}, bubble {p['bubble']:.1%}; items kept "
            f"per stage {', '.join(map(str, kept))} of {p['items_per_stage']} ({p['layers_per_item']} layers "
            f"each{room}); activations {_mib(p['activations_bytes'])} MiB by the formula ({parts} MiB)"]


def _amount(x) -> str:
    """Bytes as MiB, or KiB below one MiB (a tiny model's halos)."""
    return "-" if x is None else (mib(x) if x >= MiB else f"{x / 1024:,.1f} KiB")


# A split that moves activations (planner/split_cost.py): what it sends, what it splits,
# and the key of its own label in its report section.
SPLITS = {"tensor": ("Megatron all-reduces", "heads split", None), "stage": ("pipeline sends", "stage split", None),
          "halo": ("halo exchanges", "height split", None), "context": ("context attention", "positions split", "kind"),
          "experts": ("expert all-to-all", "experts split", "dispatch")}


def split_lines(name: str, s: dict) -> list[str]:
    """A split's collectives (its report section, split_cost.report): compiled beside its
    formula pass by pass and against its bound, then its own figures and what is not counted."""
    what, split, label = SPLITS[name]
    own = f"{s[label]}, " if label else ""
    head = (f"  {what} over {'+'.join(s['mesh_axes']) or '-'} ({own}{split} {s['split']} ways): "
            f"compiled {_amount(s.get('compiled_bytes'))}")
    if s["bytes"] is None:
        return [head + "; no formula"] + [f"    not counted: {why}" for why in s["not_counted"]]
    terms = ", ".join(f"{k} {_amount(v)}" for k, v in s["terms"].items())
    lines = [f"{head} in {s['compiled_count']:,} ops, formula {_amount(s['bytes'])} in {s['count']:,} "
             f"({_ratio(s['ratio'])}): {terms}",
             f"    bound (the formula less XLA's known excess) {_amount(s['bound_bytes'])}; compiled/bound "
             f"{_ratio(s['bound_ratio'])}"]
    if s.get("attention_flops_ratio") is not None:
        lines.append(f"    attention matmul FLOPs {s['attention_flops_ratio']:.2f}x the causal ideal; ring-step "
                     f"branches equal: {s['branches_equal']}")
    if s.get("weights"):
        w = s["weights"]
        lines.append(f"  expert weights per device: {_amount(w['params'])} params + {_amount(w['optimizer'])} "
                     f"optimizer state by the formula (compiled params {_amount(w.get('compiled_params'))}); the "
                     f"rest of the model {_amount(w['rest_params'])} + {_amount(w['rest_optimizer'])}")
    return lines + [f"    not counted: {why}" for why in s["not_counted"]]


def offload_lines(o: dict, step_s: float) -> list[str]:
    """train.offload's host share and link time (planner/host_offload.py)."""
    verdict = "fits" if o["host_fits"] else "DOES NOT FIT"
    what = ([f"train.offload={','.join(o['offload'])}"] if o["offload"] else []) + (
        [f"model.remat={o['remat']}: activations {gib(o['activation_bytes'])}"] if o["activation_bytes"] else [])
    if o["activation_bytes"] is None:
        what.append(f"model.remat={o['remat']}'s activations not counted (no tag formula for this model or schedule)")
    return [f"  offloaded ({'; '.join(what)}): {gib(o['host_bytes'])} per device in "
            f"host memory; the node's devices {gib(o['node_host_bytes'])} of its "
            f"{gib(o['host_memory_bytes'])}: {verdict}",
            f"  over the host link per step: {gib(o['to_device_bytes'])} to the device, "
            f"{gib(o['to_host_bytes'])} back: {o['link_s'] * 1e3:,.1f} ms at "
            f"{o['link_bandwidth'] / 1e9:,.0f} GB/s a way, beside a predicted step of {step_s * 1e3:,.1f} ms "
            f"(hidden where XLA overlaps it with compute, added where it cannot)"]


def render(r: dict) -> str:
    lines = [f"plan: {r.get('config_name', '')} | {r['devices']} devices, mesh "
             + ",".join(f"{a}:{n}" for a, n in r["mesh"].items() if n > 1 or a == "data")
             + (f" (dcn {r['dcn']})" if r.get("dcn") else "")
             + f" | layout {r['layout']}"
             + (f" | compiled in {r['compile_time_s']:.1f}s" if r.get("compile_time_s") is not None else ""),
             f"model: {r['model']}", f"hardware: {r['hardware']}"]
    if r.get("attention"):
        lines.append(f"attention on it: {r['attention']} (model.attention; the formulas use it, "
                     f"the CPU compile runs xla)")
    lines += ["", "memory per device (MiB)"]
    mem, formula, ratio = r["memory_per_device_bytes"], r["analytic_memory_per_device_bytes"], r["memory_ratio"]
    rows = [["", "CPU compile", "formula", "compiled/formula"]]
    rows += [[k, _mib(mem[k]), _mib(formula[k]), _ratio(ratio[k])] for k in MEMORY_KEYS]
    rows.append(["total", _mib(mem["peak_estimate"]), _mib(formula["total"]), _ratio(
        mem["peak_estimate"] / formula["total"] if formula["total"] else None)])
    lines += table(rows, right={1, 2, 3})
    fit = r["fits"]
    lines += fit_lines(fit, mem)
    if r.get("offload"):
        lines += offload_lines(r["offload"], r["prediction"]["step_time_s"])
    if r.get("pipeline"):
        lines += pipeline_lines(r["pipeline"])
    lines += ["", "collectives per step (MiB each device sends; ring algorithms)"]
    rows = [["mesh axes", "kind", "count", "MiB", "link"]]
    for c in r["collectives"]:
        rows.append(["+".join(c["mesh_axes"]) or "-", c["kind"], f"{c['count']:,}", _mib(c["bytes"]),
                     "network" if c["crosses_nodes"] else "in node"])
    lines += table(rows, right={2, 3}) if len(rows) > 1 else ["  none"]
    lines += ["", "against the lower bound"]
    rows = [["mesh axes", "MiB", "bound MiB", "ratio", "ops", "bound ops"]]
    for a in r["collectives_by_axes"]:
        rows.append(["+".join(a["mesh_axes"]) or "-", _mib(a["bytes"]), _mib(a["lower_bound_bytes"]),
                     _ratio(a["ratio"]), f"{a['count']:,}", f"{a['lower_bound_count']:,}"])
    lines += table(rows, right={1, 2, 3, 4, 5}) if len(rows) > 1 else ["  none"]
    for a in r["collectives_by_axes"]:
        for why in a["excess"]:
            lines.append(f"  why more over {'+'.join(a['mesh_axes'])}: {why}")
    for name in SPLITS:
        if r.get(name):
            lines += split_lines(name, r[name])
    total, bound = r["collective_bytes_per_step"], r["collective_lower_bound_bytes"]
    lines.append(f"  all axes: {_mib(total)} MiB against {_mib(bound)} MiB"
                 + (f" ({total / bound:.2f}x)" if bound else ""))
    lines += ["", f"FLOPs per step: compiled {r['flops_per_step']:.4g} (matmuls and convs, all devices) against "
                  f"model {r['model_flops_per_step']:.4g} ({r['flops_per_step'] / r['model_flops_per_step']:.3f}x); "
                  f"model FLOPs: {r['flops_convention'].split(';')[0]}"]
    p = r["prediction"]
    attention = f", attention {p['attention_s'] * 1e3:,.1f} ms" if p.get("attention_s") else ""
    idle = f", idle {p['idle_s'] * 1e3:,.1f} ms" if p.get("idle_s") else ""
    lines.append(f"predicted step: {p['step_time_s'] * 1e3:,.1f} ms -> MFU {100 * p['mfu']:.1f}% | matmuls "
                 f"{p['matmul_s'] * 1e3:,.1f} ms{attention}, memory {p['memory_s'] * 1e3:,.1f} ms{idle}, "
                 f"tensor/stage collectives {p['exposed_collectives_s'] * 1e3:,.1f} ms, overlapped data/fsdp "
                 f"collectives {p['overlapped_collectives_s'] * 1e3:,.1f} ms | bound by {p['bound_by']}")
    if p.get("calibration"):
        lines.append(f"  step-time figures: {p['calibration']}")
    if r.get("accum_gather"):
        lines += ["", r["accum_gather"]]
    if r.get("lint"):
        lines += ["", "lint:"] + [f"  [{f['severity']}] {f['what']} Cost: {f['cost']} Fix: {f['fix']}"
                                  for f in r["lint"]]
    return "\n".join(lines)


def largest(name: str, cfg, hw, fits: list) -> str:
    """`meshtrain plan --largest`: the deepest model that fits, per offload setting
    (`fits`: planner/capacity.py's Fit, one a setting)."""
    devices = math.prod(mesh_lib.parse_shape(cfg.mesh.shape).values())
    lines = [f"largest {cfg.model.name} at this width on {devices} x {hw.name} ({hw.hbm_bytes / 1e9:,.0f} GB "
             f"each, {hw.host_memory_bytes / 1e12:,.1f} TB of host RAM a node), by the formulas ({name}: "
             f"layout {cfg.layout if ':' not in cfg.layout else 'of its own'}, mesh {cfg.mesh.shape}, "
             f"batch {cfg.train.batch_size}, remat {cfg.model.remat}):"]
    for f in fits:
        what = (f"{f.layers} layers, {f.params / 1e9:,.2f} B params: {gib(f.device_bytes)} per device"
                + (f", {gib(f.host_bytes)} in host memory, {f.link_s:,.1f} s a step on the host link"
                   if f.host_bytes else "") + f"; one more layer exceeds {f.limit}") if f.layers else "not one layer fits"
        lines.append(f"  train.offload={f.offload:17} {what}")
    return "\n".join(lines)
