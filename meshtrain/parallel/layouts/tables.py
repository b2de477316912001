"""Readable sharding tables: `param path | logical axes | params spec | opt_state spec`,
and a `grads` spec column for a layout whose grads table is its own (ZeRO-2).

Golden copies live in tests/golden/; a change of rules shows up there as a diff.
"""

from __future__ import annotations

from meshtrain import tree_paths
from meshtrain.parallel.layouts.rules import Layout

def _fmt_axes(axes) -> str:
    return "(" + ", ".join("-" if a is None else a for a in axes) + ")"


def _fmt_spec(spec) -> str:
    return str(spec).removeprefix("PartitionSpec")


def sharding_table(axes_tree, layout: Layout, activations) -> str:
    """`axes_tree`: params-shaped dict of logical-axis tuples (ModelDef.axes);
    `activations`: [(what, logical axes)] the model constrains (ModelDef.activation_axes())."""
    grads = layout.splits_grads
    rows = [("param", "logical axes", "params", "opt_state") + (("grads",) if grads else ())]
    for name, axes in tree_paths.flat(axes_tree, is_leaf=lambda x: isinstance(x, tuple)).items():
        rows.append((name, _fmt_axes(axes), _fmt_spec(layout.spec(axes, "params")),
                     _fmt_spec(layout.spec(axes, "opt_state")))
                    + ((_fmt_spec(layout.spec(axes, "grads")),) if grads else ()))
    blank = ("",) * len(rows[0])
    rows.append(blank)
    rows.append(("activation", "logical axes", "activations") + blank[3:])
    for name, axes in activations:
        rows.append((name, _fmt_axes(axes), _fmt_spec(layout.spec(axes, "activations"))) + blank[3:])
    widths = [max(len(r[i]) for r in rows) for i in range(len(blank))]
    lines = [f"# layout {layout.name}: {layout.describe()}"]
    for r in rows:
        lines.append(" | ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() if any(r) else "")
    return "\n".join(lines) + "\n"
