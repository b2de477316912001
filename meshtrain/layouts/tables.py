"""Readable sharding tables: `param path | logical axes | params spec | opt_state spec`.

Golden copies live in tests/golden/; a change of rules shows up there as a diff.
"""

from __future__ import annotations

import jax

from meshtrain.layouts.rules import Layout

ACTIVATIONS = (
    ("residual x", ("batch", "length", "embed")),
    ("q, k, v, attention out", ("batch", "length", "heads", "head_dim")),
    ("mlp hidden", ("batch", "length", "mlp")),
    ("logits", ("batch", "length", "vocab")),
)


def _fmt_axes(axes) -> str:
    return "(" + ", ".join("-" if a is None else a for a in axes) + ")"


def _fmt_spec(spec) -> str:
    return str(spec).removeprefix("PartitionSpec")


def sharding_table(axes_tree, layout: Layout) -> str:
    """`axes_tree`: params-shaped dict of logical-axis tuples (ModelDef.axes)."""
    rows = [("param", "logical axes", "params", "opt_state")]
    flat = jax.tree_util.tree_flatten_with_path(axes_tree, is_leaf=lambda x: isinstance(x, tuple))[0]
    for path, axes in flat:
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        rows.append((name, _fmt_axes(axes), _fmt_spec(layout.spec(axes, "params")),
                     _fmt_spec(layout.spec(axes, "opt_state"))))
    rows.append(("", "", "", ""))
    rows.append(("activation", "logical axes", "activations", ""))
    for name, axes in ACTIVATIONS:
        rows.append((name, _fmt_axes(axes), _fmt_spec(layout.spec(axes, "activations")), ""))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [f"# layout {layout.name}: {layout.describe()}"]
    for r in rows:
        lines.append(" | ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() if any(r) else "")
    return "\n".join(lines) + "\n"
