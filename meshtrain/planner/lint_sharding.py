"""The linter's checks of how a layout shards the state (planner/lint.py lists every check):
replicated-param, zero-saves-nothing, unused-axis. Driven by the layout's rules and
layouts.presets.PRESET_AXES, so a new preset needs no change here."""

from __future__ import annotations

import math

from meshtrain import mesh as mesh_lib
from meshtrain.errors import MiB, mib
from meshtrain.mesh import AXES
from meshtrain.parallel import layouts
from meshtrain.parallel.layouts.rules import TARGETS, mesh_axes_of
from meshtrain.planner.findings import (Finding, Run, axes_of, axes_text, layout_text, leaves_of, mesh_text, named_axes,
                                        override)
from meshtrain.planner.split_cost import group_size

_STACKED = ("layers", "stage")


def replicated(run: Run) -> list[Finding]:
    if run.model is None:
        return []
    leaves, shape, lay = leaves_of(run.model), run.shape, run.layout
    total = sum(math.prod(s) * i for _, s, i, _ in leaves)
    used = {a for *_, axes in leaves for a in axes_of(lay, axes, "params")}
    used = [a for a in AXES if a in used and a != "stage" and shape[a] > 1]
    limit = max(MiB, total / 100)
    groups: dict = {}
    for leaf in leaves:
        path, s, item, axes = leaf
        missing = tuple(a for a in used if a not in axes_of(lay, axes, "params"))
        if missing and math.prod(s) * item >= limit:
            groups.setdefault((missing, _replication_fix(run, leaf, missing, leaves)), []).append(leaf)
    found = []
    for (missing, fix), group in groups.items():
        n, extra = group_size(shape, missing), 0.0
        for _, s, item, axes in group:
            for target, copies in (("params", 1), ("opt_state", 2)):
                have = axes_of(lay, axes, target)
                left = [a for a in missing if a not in have]
                extra += copies * math.prod(s) * item / group_size(shape, have) * (1 - 1 / group_size(shape, left))
        _, s0, i0, a0 = group[0]
        each = math.prod(s0) * i0 / group_size(shape, axes_of(lay, a0, "params"))
        simple = len(group) == 1 and lay.spec(a0, "params") == lay.spec(a0, "opt_state")
        names = " and ".join(f"{p} {list(s)} ({mib(math.prod(s) * i)})" for p, s, i, _ in group)
        each_at = "each at least" if len(group) > 1 else "at least"
        kv = " (kv_heads is kept unsplit on purpose, docs/layouts.md 'Grouped-query attention')" \
            if all("kv_heads" in a for *_, a in group) else ""
        found.append(Finding(
            "replicated-param", "warning",
            f"{'Parameters' if len(group) > 1 else 'Parameter'} {names}, {each_at} max(1 MiB, 1% of the "
            f"{mib(total)} of parameters), {'are' if len(group) > 1 else 'is'} whole over "
            f"{axes_text(shape, missing)}, on which layout {lay.name!r} splits other weights{kv}",
            f"{mib(extra)} more per device for the parameter{'s' if len(group) > 1 else ''} and "
            f"{'their' if len(group) > 1 else 'its'} 2 Adam moments than split {n} ways"
            + (f" ({mib(each)} per device x (1 - 1/{n}) x 3)" if simple else ""), fix))
    return found


def _replication_fix(run: Run, leaf, missing, leaves) -> str:
    """A layout with one more rule that splits `leaf` over `missing`, checked to parse and to
    divide every parameter (and activation, for kv_heads); else what to do, in words."""
    _, s, _, axes = leaf
    n, lay, plus = group_size(run.shape, missing), run.layout, "+".join(missing)
    free = [a for a, e in zip(axes, lay.spec(axes, "params")) if a is not None and e is None]
    if "kv_heads" in axes:
        k = s[axes.index("kv_heads")]
        if k % n:
            return (f"none in the layout: model.num_kv_heads={k} is not divisible by {plus}={n}, so the kv "
                    f"heads cannot split; accept the cost, or use a {plus} size that divides {k}")
        free, targets = ["kv_heads"], TARGETS
    else:
        targets = ("params", "opt_state", "grads")
    for name in dict.fromkeys(a for a in free if a not in _STACKED):
        if any(size % n for size, a in zip(s, axes) if a == name):
            continue
        tables = {t: lay.rules(t) + ((name, missing),) if t in targets else lay.rules(t) for t in TARGETS}
        text = layout_text(tables["params"], tables["opt_state"], tables["activations"], tables["grads"])
        new = layouts.get(text)
        if any(new.rules(t) != tables[t] for t in TARGETS) or set(missing) - set(axes_of(new, axes, "params")):
            continue
        arrays = [(sh, a, t) for _, sh, _, a in leaves for t in ("params", "opt_state")]
        if "activations" in targets:
            arrays += [(sh, a, "activations") for _, sh, a in run.model.family.activations(run.model.cfg, 1)]
        # Every dim the new rules split must divide (the batch is check_batch's); a spec may
        # leave out trailing whole dims.
        if all(size % group_size(run.shape, mesh_axes_of(e)) == 0 for sh, a, t in arrays
               for size, name, e in zip(sh, a, tuple(new.spec(a, t)) + (None,) * len(sh)) if name != "batch"):
            return override("layout", text)
    return (f"no single rule splits it evenly: none of its unsplit dims ({', '.join(free) or 'none'}) is "
            f"divisible by {plus}={n}; accept the cost, or add a rule for it by hand (docs/layouts.md)")


def zero(run: Run) -> list[Finding]:
    lay, shape = run.layout, run.shape
    zero = [a for a in ("data", "fsdp") if a in _state_axes(lay)]
    if not zero or any(shape[a] > 1 for a in zero):
        return []
    def strip(rules):
        kept = ((n, tuple(a for a in axes if n == "batch" or a not in zero)) for n, axes in rules)
        return tuple((n, axes) for n, axes in kept if axes)
    plain = _plain_preset(lay, zero) or layout_text(strip(lay.params), strip(lay.opt_state),
                                                    lay.activations, strip(lay.grads))
    over = ", ".join(f"{a}=1" for a in zero)
    cost = "12 B/param (fp32 params and Adam moments) on every device"
    if run.model is not None:
        state = sum(math.prod(s) * i * c / group_size(shape, axes_of(lay, a, t)) for _, s, i, a in leaves_of(run.model)
                    for t, c in (("params", 1), ("opt_state", 2)))
        cost = f"{mib(state)} of params and Adam moments per device"
    cost += (f", the same as {plain!r}: the sharding rules meet axes of size 1, so nothing is saved "
             f"(and no collective is added either)")
    fix = override("layout", plain) + " (the same run, named for what it does"
    src = [a for a in ("data", "fsdp") if a not in zero and shape[a] > 1]
    if src:
        new = {**shape, zero[0]: shape[src[0]], src[0]: 1}
        fix += f"; to shard instead, move the devices onto {zero[0]}: {override('mesh.shape', mesh_text(new))}"
        if run.dcn and run.dcn[src[0]] > 1:
            dcn = {**run.dcn, zero[0]: run.dcn[src[0]], src[0]: 1}
            fix += " " + override("mesh.dcn", mesh_lib.format_factors(dcn))
    return [Finding("zero-saves-nothing", "warning",
                    f"layout {lay.name!r} shards weights, gradients or optimizer moments over {'/'.join(zero)}, but the "
                    f"mesh has {over} ({mesh_text(shape)})", cost, fix + ")")]


def unused(run: Run) -> list[Finding]:
    lay, shape = run.layout, run.shape
    idle = [a for a in AXES if shape[a] > 1 and a not in named_axes(lay)]
    if not idle:
        return []
    big = {a for a in AXES if shape[a] > 1}
    fits = [name for name, (needs, may) in layouts.presets.PRESET_AXES.items() if needs <= big <= may]
    # Keep the layout's kind where one fits (zero1 stays zero1, fsdp stays fsdp).
    fits.sort(key=lambda name: name.split("_")[0] != lay.name.split("_")[0])
    fix = override("layout", fits[0]) if fits else (
        f"no preset uses {mesh_text(shape)}: put the devices on the axes layout {lay.name!r} names, "
        f"or write rules for {', '.join(idle)} (docs/layouts.md)")
    n = group_size(shape, idle)
    return [Finding("unused-axis", "warning",
                    f"mesh {mesh_text(shape)} has {axes_text(shape, idle)}, which layout {lay.name!r} never "
                    f"names: the {n} devices along {'+'.join(idle)} hold the same weights and compute the same rows",
                    f"{n}x the work per step for the same result: {n - 1} of every {n} devices add nothing",
                    fix)]


def _plain_preset(lay, axes: list[str]) -> str | None:
    """The preset that runs the same program as `lay` when `axes` have size 1 and that
    shards nothing over them (fsdp_tp -> dp_tp, zero1 -> dp), found by comparing rules
    among layouts.presets.PRESETS, so a new preset joins by itself; None if none does."""
    def norm(layout):
        return tuple(tuple((n, kept) for n, a in layout.rules(t) if not (n == "batch" and t != "activations")
                           for kept in [tuple(x for x in a if x not in axes)] if kept) for t in TARGETS)
    want = norm(lay)
    for name in layouts.presets.PRESETS:
        other = layouts.get(name)
        if name != lay.name and not _state_axes(other) & set(axes) and norm(other) == want:
            return name
    return None


def _state_axes(lay) -> set[str]:
    """The mesh axes `lay` shards the state over: weights, gradients or moments (not the batch)."""
    return {a for t in ("params", "opt_state", "grads") for n, axes in lay.rules(t) if n != "batch" for a in axes}
