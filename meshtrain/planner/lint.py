"""Layout linter: what a config's layout costs on its mesh, found before anything compiles
(docs/layouts.md, "Linter", lists every check with its cost and fix).

    findings = lint(cfg, mesh_shape, dcn, model, hw)  # [Finding(code, severity, what, cost, fix)]

Each finding says what is wrong, with the numbers, what it costs, and a fix: `--config.key=value`
overrides (shell-quoted), then prose in parentheses, or prose alone; `fix_overrides(fix)`
reads the overrides back. The checks here: batch-indivisible, tensor-over-heads,
sequence-indivisible (2 n must divide model.seq_len), tensor-, context- and expert-on-dcn
(the plan report's bound for that axis, bounds.SPLIT_COSTS, at a ring's share of its nodes'
NICs, roofline.ring_bandwidth), gradients-on-dcn (the data gradients' reduction across
nodes outlasting the matmuls, where train.grad_compression would cut it), pipeline-bubble
((S-1)/(r*M+S-1) over BUBBLE_LIMIT) and pipeline-activations. The sharding checks (replicated-param, zero-saves-nothing, unused-axis)
are planner/lint_sharding.py's, the MoE ones (experts-indivisible, capacity-drops)
planner/lint_experts.py's, `Finding` and the shared arithmetic planner/findings.py's.
`stage` on DCN is not flagged: a pipeline sends one microbatch slot between neighbouring
stages per tick, the lightest traffic of any axis (docs/multihost.md). Bandwidths are
GB/s = 1e9 bytes/s per direction.
"""

from __future__ import annotations

import copy
import dataclasses
import math

from meshtrain import config as config_lib, mesh as mesh_lib, models
from meshtrain.errors import GiB, UserError, mib
from meshtrain.mesh import AXES
from meshtrain.parallel import layouts, sequence
from meshtrain.parallel.pipeline.scan import Pipeline
from meshtrain.planner import analytic, bounds, hardware as hardware_lib, lint_experts, roofline
from meshtrain.runlog import metrics
from meshtrain.planner.findings import (Finding, Run, axes_text, batch_multiple, fix_overrides, mesh_text, named_axes,
                                        override, surplus_to_data)
from meshtrain.planner.lint_sharding import replicated, unused, zero
from meshtrain.planner.split_cost import group_size, split_over

__all__ = ["Finding", "fix_overrides", "lint"]
BUBBLE_LIMIT = 0.25                      # the largest idle share of a pipelined step not flagged
SAVES_A_LOT = 0.25                       # share of the device's usable memory 1F1B must save to be flagged
ROUND = 32                              # the DiLoCo round the gradients-on-dcn lint prices
SLOW_GRADIENTS = 0.25                    # share of the gradients' exposed time compression must save to be suggested


def lint(cfg, mesh_shape: dict[str, int] | None = None, dcn: dict[str, int] | None = None,
         model=None, hw=None) -> list[Finding]:
    """Findings for `cfg` (a locked config), errors first.

    mesh_shape: the resolved size of every axis of mesh.AXES (default: cfg.mesh.shape, with no
    -1); dcn: the inter-node factor of each axis (default: mesh.parse_dcn(cfg.mesh.dcn, shape));
    model: a state.ModelDef (Experiment.model, or validate(...).model) for the checks that need
    parameter shapes; without it the model's dims come from model.size and model.* overrides.
    hw: the planner/hardware.py entry whose links the costs quote (default h100).
    Raises UserError only for a config it cannot read (unknown layout, bad mesh or model size).
    """
    shape = mesh_lib.parse_shape(mesh_shape if mesh_shape is not None else cfg.mesh.shape)
    if -1 in shape.values():
        raise UserError(f"lint needs every mesh axis sized, but mesh.shape={cfg.mesh.shape!r} has a -1; "
                        f"pass the resolved shape (mesh.resolve_shape with the device count).")
    if dcn is None:
        dcn = mesh_lib.parse_dcn(cfg.mesh.dcn, shape)
    dims = dataclasses.asdict(model.cfg) if model is not None else models.size_dims(cfg.model)
    run = Run(cfg, layouts.get(cfg.layout), shape, dcn, dims, model, hw or hardware_lib.TABLE["h100"])
    found = [*_batch(run), *_heads(run), *_sequence(run), *lint_experts.indivisible(run),
             *lint_experts.capacity_drops(run), *unused(run), *replicated(run), *_on_dcn(run), *_bubble(run),
             *zero(run), *_pipeline_activations(run), *_gradients_on_dcn(run)]
    return sorted(found, key=lambda f: f.severity != "error")


# ----------------------------------------------------------------------------------- checks

def _batch(run: Run) -> list[Finding]:
    t, m = run.cfg.train, max(run.cfg.pipeline.microbatches, 0)
    if t.grad_accum_steps < 1:
        return []  # validation refuses it, with its own message
    q, b = batch_multiple(run, m), t.batch_size
    if b >= 1 and b % q == 0:
        return []
    k, outer = t.grad_accum_steps, split_over(run.layout, run.shape, "batch")[0]
    why = f"train.grad_accum_steps x batch shards = {k} x {outer}"
    if m > 0:
        inner = split_over(run.layout.without("stage"), run.shape, "batch")[0]
        why = (f"lcm({why}, train.grad_accum_steps x pipeline.microbatches x batch shards in a stage = "
               f"{k} x {m} x {inner})")
    return [Finding("batch-indivisible", "error",
                    f"train.batch_size={b} is not a multiple of {q} = {why} under layout {run.layout.name!r} "
                    f"on mesh {mesh_text(run.shape)}",
                    "the run cannot start: validation refuses a batch that does not split evenly",
                    override("train.batch_size", _nearest_multiple(b, q)))]


def _nearest_multiple(x: int, q: int) -> int:
    """The positive multiple of q nearest x, the larger on a tie (a batch or a sequence)."""
    lo, hi = x // q * q, max(-(-x // q), 1) * q
    return hi if lo < 1 or hi - x <= x - lo else lo


def _heads(run: Run) -> list[Finding]:
    h, (n, over) = run.dims.get("num_heads"), split_over(run.layout, run.shape, "heads", target=None)
    if not h or "tensor" not in over or h % n == 0:
        return []
    more = f"{n} ranks for {h} heads" if n > h else f"{h} is not divisible by {n}"
    return [Finding("tensor-over-heads", "error",
                    f"layout {run.layout.name!r} splits the model.num_heads={h} attention heads over "
                    f"{axes_text(run.shape, over)}: {more}",
                    "the run cannot start: validation refuses heads that do not split evenly "
                    "(every rank needs whole heads)", surplus_to_data(run, "tensor", over, h, "num_heads"))]


def _sequence(run: Run) -> list[Finding]:
    t = run.dims.get("seq_len")
    n, axes = sequence.split(run.layout, run.shape)
    if not isinstance(t, int) or n <= 1 or t % (2 * n) == 0:
        return []
    q = 2 * n
    return [Finding("sequence-indivisible", "error",
                    f"layout {run.layout.name!r} splits attention's positions over {axes_text(run.shape, axes)}: "
                    f"context parallelism cuts model.seq_len={t} into 2 x {n} = {q} equal chunks (each device "
                    f"holds an early and a late one), and {q} does not divide {t}",
                    "the run cannot start: validation refuses a sequence that does not split evenly",
                    override("model.seq_len", _nearest_multiple(t, q)) + f" (or a smaller {'+'.join(axes)} axis)")]


# --------------------------------------------------------------------- an axis across nodes

# Per axis whose collectives should stay inside a node (<axis>-on-dcn), in the findings' order:
# its plan report section (bounds.SPLIT_COSTS), what shares a node's NICs (a "ring": all-reduce,
# ring attention; an all-to-all's "group"), what crosses the nodes (the finding's what), the
# cost's subject where the bytes are unknown, and what the bytes are ({dtype}: the model's).
_ACROSS = {
    "tensor": ("tensor", "ring", "tensor parallelism all-reduces activations in every layer, forward and backward",
               "the tensor all-reduces", "tensor all-reduces (Megatron's 4 a layer of [rows, positions on the device, "
               "embed] in {dtype}, 2(t-1)/t on the wire, and the vocabulary-parallel embedding's: the plan report's "
               "tensor bound)"),
    "context": ("context", "ring", "context parallelism passes every layer's keys and values between the devices "
                "of a sequence, forward and backward", "the keys and values",
                "keys and values (k and v of the kv heads a device holds, [rows, T/n, kv heads x head_dim] in {dtype} "
                "per layer, (n-1)/n of them arriving on each device, forward and their gradients backward: the plan "
                "report's context bound)"),
    "expert": ("experts", "group", "every MoE layer's dispatch and combine all-to-alls send each token's embedding "
               "to its experts and back, forward and backward", "the all-to-alls",
               "dispatch and combine all-to-alls, forward and backward (the plan report's experts bound)"),
}


def _on_dcn(run: Run) -> list[Finding]:
    dcn, shape, hw, found, built = run.dcn, run.shape, run.hw, [], {}
    for axis, (section, group, sends, subject, words) in _ACROSS.items():
        if not dcn or dcn[axis] <= 1:
            continue
        # Context's traffic is attention's: only a layout splitting its positions sends it. A
        # tensor or expert axis no rule names is unused-axis's.
        over = sequence.split(run.layout, shape)[1] if axis == "context" else named_axes(run.layout)
        if axis not in over:
            continue
        f = dcn[axis]
        # The roofline's ring across nodes (roofline.ring_bandwidth): the node's NICs shared by
        # the rings (an all-to-all's groups alike) along `axis` that cross it.
        rings = max(group_size(shape, AXES) // math.prod(dcn.values()) // max(shape[axis] // f, 1), 1)
        net, link = roofline.ring_bandwidth(hw, rings) / 1e9, hw.link_bandwidth / 1e9
        ratio = (f"~{net:,.0f} GB/s a {group} ({hw.nics} x {hw.network_bandwidth * 8 / 1e9:,.0f} Gb/s NICs a node "
                 f"shared by the {rings} {axis} {group}s crossing it) instead of ~{link:,.0f} GB/s over the links in "
                 f"a node: {link / net:.1f}x slower")
        dtype = run.model.cfg.dtype if run.model is not None else run.cfg.model.dtype
        source, wire = f"{hw.name}: {hw.source}", _bound(run, section, built)
        cost = f"{subject} go at {ratio} ({source})"
        if wire:
            cost = (f"about {mib(wire)} per device per step of {words.format(dtype=dtype)} go at {ratio}, at least "
                    f"{wire / net / 1e6:,.1f} ms instead of {wire / link / 1e6:,.1f} ms per step ({source})")
        # The fix: those nodes on data, else on fsdp.
        to = next((to for to in ("data", "fsdp") if shape[to] % (dcn[to] * f) == 0), None)
        fix = override("mesh.dcn", mesh_lib.format_factors({**dcn, to: dcn[to] * f, axis: 1})) if to else (
            f"neither data={shape['data']} nor fsdp={shape['fsdp']} can take the {f} nodes: change mesh.shape "
            f"so data is a multiple of {dcn['data'] * f}, then put the nodes on data in mesh.dcn")
        found.append(Finding(f"{axis}-on-dcn", "warning",
                             f"mesh.dcn={mesh_lib.format_factors(dcn)} puts the {axis} axis ({axis}={shape[axis]}) "
                             f"across {f} nodes: {sends}, and should stay inside a node", cost, fix))
    return found


def _bound(run: Run, section: str, built: dict) -> float | None:
    """The plan report's bound of `section` (bounds.SPLIT_COSTS), bytes per device per step,
    on an abstract mesh of the run's shape (built once into `built`); None where the config
    does not build or the split has no formula."""
    t = _abstract(run, built) and bounds.SPLIT_COSTS[section].traffic(built["exp"])
    return t.bound_bytes if t else None


def _abstract(run: Run, built: dict, **overrides):
    """run's config on an abstract mesh of its shape (analytic.abstract_experiment), with
    `overrides` (config keys), built once a set into `built`; None where it does not build."""
    key = "exp" if not overrides else tuple(sorted(overrides.items()))
    if key not in built:
        cfg = run.cfg
        if overrides:
            cfg = copy.deepcopy(run.cfg)
            for k, v in overrides.items():
                config_lib.override(cfg, k, v)
        try:
            built[key] = analytic.abstract_experiment(cfg, run.model, run.layout, shape=run.shape)
        except UserError:
            built[key] = None
    return built[key]


def _gradients_on_dcn(run: Run) -> list[Finding]:
    """data across nodes on a link slow for the gradients: their reduction across nodes
    (the two-level float32 all-reduce, roofline.collective_seconds) against the step's
    matmuls, and what train.grad_compression would take instead."""
    dcn, shape, hw, built = run.dcn, run.shape, run.hw, {}
    t = run.cfg.train
    if not dcn or dcn["data"] <= 1 or t.grad_compression != "none" or run.cfg.diloco.every:
        return []
    times = {}
    for kind in ("none", "int8", "onebit"):
        exp = _abstract(run, built, **({"train.grad_compression": kind} if kind != "none" else {}))
        if exp is None or not getattr(exp.model.cfg, "seq_len", 0):
            return []  # the layout cannot compress (its gradients are not whole per data replica)
        times[kind] = sum(roofline.collective_seconds(hw, {**r, **_across_data(r, shape, dcn, hw)})
                          for r in bounds.collective_bounds(exp) if list(r["mesh_axes"]) == ["data"])
    cfg = exp.model.cfg
    matmuls = metrics.flops_per_unit(cfg) * t.batch_size * cfg.seq_len / math.prod(shape.values()) / (
        hw.peak(cfg.dtype) * hw.matmul_efficiency)
    # XLA overlaps the replicas' reduction with the backward pass: what outlasts the matmuls
    # shows in the step (the roofline's rule). Flagged where that is so and compression saves.
    exposed = {k: max(v - matmuls, 0.0) for k, v in times.items()}
    # DiLoCo's outer step runs alone, once a round (no matmuls to hide behind): a round of
    # ROUND steps, a step's share of it
    local = _abstract(run, built, **{"diloco.every": str(ROUND)})
    if local is not None:
        times["diloco"] = sum(roofline.collective_seconds(hw, {**r, **_across_data(r, shape, dcn, hw)})
                              for r in bounds.collective_bounds(local) if list(r["mesh_axes"]) == ["data"])
        exposed["diloco"] = times["diloco"]
    saving = [k for k in ("int8", "onebit", "diloco")
              if k in exposed and exposed[k] <= (1 - SLOW_GRADIENTS) * exposed["none"]]
    if not exposed["none"] or not saving:
        return []
    ms = {k: f"{v * 1e3:,.3g} ms" for k, v in {**times, "matmuls": matmuls}.items()}
    shown = {k: f"{v * 1e3:,.3g} ms" for k, v in exposed.items()}
    why = {"int8": "a byte a value across nodes: docs/performance.md measures its loss within 0.2% of "
                   "float32's", "onebit": "a thirty-second of the bytes, a few percent of loss",
           "diloco": f"DiLoCo, the nodes meeting every {ROUND} steps: {ms.get('diloco', '')} a step over data, a "
                     f"round's outer step included; "
                     f"docs/performance.md measures rounds of 8 within 1% of the loss with outer lr 1 - momentum"}
    return [Finding(
        "gradients-on-dcn", "warning",
        f"mesh.dcn={mesh_lib.format_factors(dcn)} puts the data axis across {dcn['data']} nodes, and the gradient "
        f"reduction across them takes {ms['none']} a step on {hw.name}'s network, longer than the {ms['matmuls']} "
        f"of matmuls XLA can hide it behind",
        f"about {shown['none']} a step exposed (a two-level all-reduce at the node's NICs: {hw.source}); with its "
        f"in-node phases, int8 would take {ms['int8']} ({shown['int8']} exposed), onebit {ms['onebit']} "
        f"({shown['onebit']})",
        ", or ".join(f"{override('diloco.every', ROUND) if k == 'diloco' else override('train.grad_compression', k)} "
                     f"({why[k]})" for k in saving))]


def _across_data(row: dict, shape: dict, dcn: dict, hw) -> dict:
    """How a data-axis row's groups sit on nodes (roofline.placement's fields, from the
    shape and mesh.dcn alone): the whole axis, m = data / k devices a node, or a
    hierarchical reduction's groups inside a node or across the k nodes (one device a node)."""
    k = dcn["data"]
    m = shape["data"] // k
    if row.get("in_node"):
        return {"crosses_nodes": False, "nodes": 1}
    # compression's phases and DiLoCo's outer all-reduce run across, one device a node
    whole = row["kind"] == "all-reduce" and not row.get("across")
    per_node, size = (m, shape["data"]) if whole else (1, k)
    return {"crosses_nodes": True, "nodes": k, "per_node": per_node, "group_size": size,
            "groups_per_node": max(hw.devices_per_node // per_node, 1)}


# ----------------------------------------------------------------------------------- pipeline

def _bubble(run: Run) -> list[Finding]:
    p, s = run.cfg.pipeline, run.shape["stage"]
    m, r = p.microbatches, (p.repeats if p.schedule in ("circular", "interleaved", "zb") else 1)
    if s <= 1 or m <= 0 or r < 1:
        return []
    def idle(m, schedule=p.schedule):  # Pipeline.bubble, the one formula of each schedule
        return Pipeline(s, m, r, schedule=schedule).bubble
    bubble = idle(m)
    if bubble <= BUBBLE_LIMIT:
        return []
    step = s if r > 1 else 1
    # the smallest M with an idle share <= 25%: r M >= 3 (S-1), or 2 (S-1) under zb
    need = -(-(2 if p.schedule == "zb" else 3) * (s - 1) // r)
    low = -(-need // step) * step
    b, k = run.cfg.train.batch_size, run.cfg.train.grad_accum_steps
    top = b // max(k * split_over(run.layout.without("stage"), run.shape, "batch")[0], 1)
    fits = [x for x in range(low, top + 1, step) if b % batch_multiple(run, x) == 0]
    new = fits[0] if fits else low
    fix, grow = override("pipeline.microbatches", new), ""
    if not fits:
        q = batch_multiple(run, new)
        grown = -(-b // q) * q
        fix += " " + override("train.batch_size", grown)
        grow = f"; the batch must grow to {grown} for {new} microbatches to divide it"
    sign = "<" if m < s else "with"
    if p.schedule == "zb":
        formula = f"2(S-1)/(3rM+2(S-1)) = {2 * (s - 1)}/{3 * r * m + 2 * (s - 1)}"
        after, other = f"{2 * (s - 1)}/{3 * r * new + 2 * (s - 1)} = {idle(new):.1%}", ""
    else:
        formula = f"(S-1)/(r*M+S-1) = {s - 1}/{r * m + s - 1}"
        after = f"{s - 1}/{r * new + s - 1} = {idle(new):.1%}"
        other = (f"; {override('pipeline.schedule', 'zb')} (ZB-H1, weight gradients in the idle ticks) idles "
                 f"{idle(m, 'zb'):.1%} at M={m}" if p.schedule in ("1f1b", "interleaved", "gpipe") else "")
    return [Finding("pipeline-bubble", "warning",
                    f"pipeline.microbatches={m} {sign} stage={s}: the bubble {formula} = {bubble:.1%} of the "
                    f"pipelined work is idle, over {BUBBLE_LIMIT:.0%}",
                    f"{bubble:.1%} of each pipelined step idle; with M={new} it is {after}{grow}{other}", fix)]


def _pipeline_activations(run: Run) -> list[Finding]:
    pipe = run.model.pipeline if run.model is not None else None
    if pipe is None or pipe.one_f_one_b or run.model.family.layer_activation_bytes is None:
        return []
    alt = "1f1b" if pipe.repeats == 1 else "interleaved"
    now, then, lean = (_formula_memory(run, dataclasses.replace(pipe, schedule=sched, stash=stash))
                       for sched, stash in ((pipe.schedule, pipe.stash), (alt, pipe.stash), (alt, "residuals")))
    usable = run.hw.hbm_bytes * run.hw.usable_memory
    (act, total), (act1, total1) = now, then
    saved = act - act1
    if not ((total > usable >= total1) or saved >= SAVES_A_LOT * usable):
        return []
    from meshtrain.planner import pipeline_memory
    kept = pipeline_memory.items_kept(dataclasses.replace(pipe, schedule=alt))[0]
    fits = "does not fit" if total > usable else "fits"
    g = lambda b: f"{b / GiB:,.2f} GiB"  # noqa: E731
    what = "chunk inputs, recomputing one item's residuals at a time for 4/3 of the layers' FLOPs" \
        if pipe.stash == "inputs" else "residuals"
    fix = override("pipeline.schedule", alt)
    if pipe.stash == "inputs" and lean[1] <= usable:
        fix += (f" (or with {override('pipeline.stash', 'residuals')}, no recompute: activations "
                f"{g(lean[0])}, total {g(lean[1])})")
    return [Finding(
        "pipeline-activations", "warning",
        f"pipeline.schedule={pipe.schedule} keeps all M={pipe.microbatches} microbatches' activations for the "
        f"stage's {run.model.cfg.num_layers // pipe.stages} layers until the backward pass: {g(act)} per device; "
        f"the step {fits} on {run.hw.name} by the formulas, {g(total)} of {g(usable)} usable",
        f"{g(saved)} of activations per device: {g(act)} under {pipe.schedule} against {g(act1)} under {alt}, "
        f"whose stage 0 keeps {kept} of {pipe.repeats * pipe.microbatches} items (its {what}; "
        f"same bubble); total {g(total)} against {g(total1)}", fix)]


def _formula_memory(run: Run, pipe) -> tuple[float, float]:
    """(activations, total) bytes per device by the formulas (planner/analytic.py) with the
    model pipelined by `pipe`, on an abstract mesh of the run's shape."""
    once = run.cfg.train.accum_gather == "once"
    exp = analytic.abstract_experiment(run.cfg, dataclasses.replace(run.model, pipeline=pipe), run.layout,
                                       "once" if once else "each", run.shape)
    memory = analytic.memory(exp, run.hw)
    return memory["activations"], sum(v or 0.0 for v in memory.values())
