"""Pictures of layouts and the planner's reports: figures for the notebooks
(notebooks/layouts.ipynb, notebooks/scaling.ipynb) and text for the terminal.

  sharding_picture(ax, shape, sharding)   one array's shards as rectangles, labelled with
                                          the devices that hold each block
  layout_figure(exp)                      a grid of those for an Experiment's main weights
  compare_figure(reports)                 memory per device and bytes per mesh axis, layout
                                          against layout (report.plan dicts)
  scaling_figure(rows)                    memory and predicted step time against device
                                          count, one line per strategy (scaling_row dicts)

A spatial layout's rows and halos are drawn by pictures/spatial.py; the planner's reports
as text for a terminal (`meshtrain plan`) by pictures/text.py.

matplotlib is imported inside the functions, and no backend is chosen here: a notebook
gets its inline backend, a script whatever matplotlib picks (Agg without a display).
Functions that make a figure use pyplot and return the Figure; close it when done.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

MEMORY_KEYS = ("params", "optimizer", "gradients", "activations")  # planner.report.MEMORY_KEYS (a test checks)


# --- one array -----------------------------------------------------------------------------

def format_ids(ids: Iterable[int]) -> str:
    """Device ids as a short label: [3] -> "3", [0, 4] -> "0,4", [0, 1, 2, 3] -> "0-3",
    [0, 1, 2, 3, 8, 9, 10, 11] -> "0-3,8-11"."""
    ids = sorted(set(ids))
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]},{r[1]}" if len(r) == 2 else f"{r[0]}-{r[-1]}"
                    for r in runs)


def _span(s: slice, n: int) -> tuple[int, int]:
    start, stop, _ = s.indices(n)
    return start, stop


def shard_blocks(shape: Sequence[int], sharding) -> dict[tuple[tuple[int, int], ...], list[int]]:
    """{block: sorted device ids holding it}: a block is ((start, stop) per dim) of `shape`,
    from `sharding.devices_indices_map(shape)`. Replicated blocks list several devices."""
    shape = tuple(int(n) for n in shape)
    blocks: dict[tuple[tuple[int, int], ...], list[int]] = {}
    for device, index in sharding.devices_indices_map(shape).items():
        key = tuple(_span(s, n) for s, n in zip(index, shape))
        blocks.setdefault(key, []).append(device.id)
    return {k: sorted(v) for k, v in blocks.items()}


def drawn_dims(shape: Sequence[int], blocks) -> tuple[list[int], list[int]]:
    """(row dims, column dims) the picture shows: the sharded dims (with more than two, the
    last is the columns and the others share the rows, block by block), topped up with the
    largest unsharded dims; each list in the array's dim order, either may be empty."""
    shape = tuple(shape)
    split = [d for d in range(len(shape)) if len({b[d] for b in blocks}) > 1]
    if len(split) > 2:
        return split[:-1], split[-1:]
    rest = sorted((d for d in range(len(shape)) if d not in split), key=lambda d: (-shape[d], d))
    dims = sorted(split + rest[:2 - len(split)])
    if len(dims) == 2:
        return [dims[0]], [dims[1]]
    return [], dims  # a vector is one row; a scalar one cell


def _placement(block, dims: list[int], shape) -> tuple[int, int]:
    """Offset and extent of `block` along a picture axis made of `dims`, block-major: the
    blocks of the first dim in order, within each those of the next, and so on. For one
    dim this is the element range itself."""
    offset, extent = 0, 1
    for j, d in enumerate(dims):
        start, stop = block[d]
        before = math.prod(block[i][1] - block[i][0] for i in dims[:j])
        after = math.prod(shape[i] for i in dims[j + 1:])
        offset += start * before * after
        extent *= stop - start
    return offset, extent


def _dim_label(dims: list[int], shape, names) -> str:
    if not dims:
        return "1"
    return " x ".join(f"{names[d] if names and names[d] else f'dim {d}'}={shape[d]}" for d in dims)


def sharding_picture(ax, shape: Sequence[int], sharding, title: str | None = None,
                     dim_names: Sequence[str | None] | None = None, colors: dict | None = None,
                     label: bool = True):
    """Draws how one array is split over devices, like jax.debug.visualize_array_sharding
    but as a picture.

    ax:        a matplotlib Axes
    shape:     the array's global shape, any rank (a tuple of ints)
    sharding:  a jax.sharding.Sharding (e.g. NamedSharding(mesh, P(...)));
               `sharding.devices_indices_map(shape)` gives each device's slice
    title:     first line of the title (e.g. the parameter's path); the second line says
               which dims are drawn: rows / columns, by `dim_names` (logical axes, one per
               dim, None for an unnamed dim) or by number
    colors:    {device-id tuple: colour} to share colours between pictures (filled in)
    label:     write the device ids in each block ("3", "0,4", "0-3")

    Draws one Rectangle patch per distinct block of the array (blocks held by several
    devices are drawn once, labelled with all of them, and coloured by that set of
    devices), so `len(ax.patches) == len(shard_blocks(shape, sharding))`. The picture
    shows the sharded dims: with one, beside it the largest other dim; with none, the two
    largest dims; with more than two, the last one across and the others down (block by
    block). Rows run down, columns across, in elements. Returns ax.
    """
    from matplotlib.patches import Rectangle

    shape = tuple(int(n) for n in shape)
    blocks = shard_blocks(shape, sharding)
    rows, cols = drawn_dims(shape, blocks)
    height = math.prod(shape[d] for d in rows)
    width = math.prod(shape[d] for d in cols)
    colors = {} if colors is None else colors
    small = len(blocks) > 32
    for block, ids in sorted(blocks.items()):
        y, h = _placement(block, rows, shape)
        x, w = _placement(block, cols, shape)
        key = tuple(ids)
        if key not in colors:
            colors[key] = palette(len(colors))
        ax.add_patch(Rectangle((x, y), w, h, facecolor=colors[key], edgecolor="black", linewidth=0.8))
        if label:
            ax.text(x + w / 2, y + h / 2, format_ids(ids), ha="center", va="center",
                    fontsize=6 if small else 8, clip_on=True)
    ax.set_xlim(0, width)
    ax.set_ylim(height, 0)
    ax.set_xlabel(_dim_label(cols, shape, dim_names), fontsize=8)
    ax.set_ylabel(_dim_label(rows, shape, dim_names), fontsize=8)
    ax.tick_params(labelsize=7)
    drawn = f"rows {_dim_label(rows, shape, dim_names)}, cols {_dim_label(cols, shape, dim_names)}"
    head = f"{title} {list(shape)}" if title else f"{list(shape)}"
    ax.set_title(f"{head}\n{drawn}", fontsize=8)
    return ax


def palette(i: int):
    """The i-th colour of the pictures' palette (tab20, strong shades first)."""
    import matplotlib

    cmap = matplotlib.colormaps["tab20"]
    return cmap((i * 2) % 20 + (i // 10) % 2)  # the strong shades first, then the light ones


# --- one Experiment ------------------------------------------------------------------------

def main_leaves(exp) -> list[str]:
    """Paths of the model's weight matrices: leaves with at least two dims other than the
    stacked `layers`/`stage` ones (GPT-2: wte, wpe, w_qkv, w_out, w_fc, w_proj)."""
    from meshtrain import tree_paths

    axes = tree_paths.flat(exp.model.axes, is_leaf=lambda x: isinstance(x, tuple))
    return [p for p, a in axes.items() if sum(n not in ("layers", "stage") for n in a) >= 2]


def mesh_caption(mesh) -> str:
    """'data:2 x tensor:4' and the device ids along the axes above 1, for a figure title."""
    import numpy as np

    used = [a for a in mesh.axis_names if mesh.shape[a] > 1]
    ids = np.vectorize(lambda d: d.id)(mesh.devices).reshape([mesh.shape[a] for a in used] or [1])
    grid = np.array2string(ids, separator=" ").replace("\n", "")
    return f"mesh {' x '.join(f'{a}:{mesh.shape[a]}' for a in used) or 'one device'}, device ids {grid}"


def layout_figure(exp, leaves: Sequence[str] | None = None, target: str = "params", ncols: int = 3,
                  title: str | None = None, cell: tuple[float, float] = (3.4, 2.6)):
    """A grid of sharding_pictures, one per parameter of one Experiment.

    exp:     a built meshtrain.run.experiment.Experiment (nothing is compiled or allocated):
             exp.model.shapes gives each parameter's shape, exp.shardings.params (target
             "params") or exp.grad_shardings (target "opt_state": where the Adam moments
             live and gradients are reduced to; ZeRO-1 differs from dp only there) its
             sharding, exp.model.axes the logical names of its dims
    leaves:  parameter paths ("blocks/attn/w_qkv", as meshtrain.tree_paths.flat names them);
             None: main_leaves(exp), the weight matrices
    Returns the Figure; colours are shared by all panels, so a device (or a replica set)
    has one colour throughout.
    """
    import matplotlib.pyplot as plt

    from meshtrain import tree_paths

    shapes = tree_paths.flat(exp.model.shapes)
    axes = tree_paths.flat(exp.model.axes, is_leaf=lambda x: isinstance(x, tuple))
    if target not in ("params", "opt_state"):
        raise ValueError(f"target={target!r}: choose 'params' or 'opt_state'")
    shardings = tree_paths.flat(exp.shardings.params if target == "params" else exp.grad_shardings)
    leaves = list(main_leaves(exp) if leaves is None else leaves)
    unknown = [p for p in leaves if p not in shapes]
    if unknown:
        raise KeyError(f"no parameter {', '.join(unknown)}; the parameters are {', '.join(shapes)}")
    ncols = max(1, min(ncols, len(leaves)))
    nrows = max(1, -(-len(leaves) // ncols))
    fig, grid = plt.subplots(nrows, ncols, figsize=(cell[0] * ncols, cell[1] * nrows + 0.8),
                             squeeze=False, constrained_layout=True)
    colors: dict = {}
    for ax, path in zip(grid.flat, leaves):
        sharding_picture(ax, shapes[path].shape, shardings[path], title=path,
                         dim_names=axes[path], colors=colors)
    for ax in list(grid.flat)[len(leaves):]:
        ax.set_visible(False)
    head = f"{title}: " if title else ""
    fig.suptitle(f"{head}{target} under layout {exp.layout.name}\n{mesh_caption(exp.mesh)}", fontsize=10)
    return fig


# --- reports -------------------------------------------------------------------------------

def _unit(largest: float) -> tuple[float, str]:
    for scale, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if largest >= scale:
            return scale, name
    return 1, "bytes"


def compare_figure(reports: Mapping[str, dict]):
    """Bar charts of several layouts' planner reports (report.plan dicts).

    reports: {label: report} in the order to draw, each with
             analytic_memory_per_device_bytes and memory_per_device_bytes (dicts with
             params, optimizer, gradients, activations: bytes per device) and
             collectives_by_axes ([{mesh_axes, bytes, lower_bound_bytes}]: bytes each device
             sends per step over that group of mesh axes)
    Three panels: memory per device by the formulas, stacked params / optimizer /
    gradients / activations; the same from the compiled step (the CPU compiler's
    activations and temporaries; negative remainders drawn as 0); and the bytes each
    device sends per step, stacked by mesh-axes group, with the layout's lower bound (all
    groups) as a black tick.
    Returns the Figure.
    """
    import matplotlib.pyplot as plt
    import numpy as np

    labels = list(reports)
    if not labels:
        raise ValueError("compare_figure needs at least one report")
    fig, axs = plt.subplots(1, 3, figsize=(max(12.0, 3 * (1.5 + 0.7 * len(labels))), 4.2),
                            constrained_layout=True)
    x = np.arange(len(labels))
    mem = {src: [{k: max(0.0, float(r[src].get(k) or 0.0)) for k in MEMORY_KEYS} for r in reports.values()]
           for src in ("analytic_memory_per_device_bytes", "memory_per_device_bytes")}
    scale, unit = _unit(max(sum(m.values()) for ms in mem.values() for m in ms))
    top = max(sum(m.values()) for ms in mem.values() for m in ms) / scale
    for ax, (src, what) in zip(axs, (("analytic_memory_per_device_bytes", "formulas"),
                                     ("memory_per_device_bytes", "compiled (CPU)"))):
        bottom = np.zeros(len(labels))
        for i, k in enumerate(MEMORY_KEYS):
            vals = np.array([m[k] for m in mem[src]]) / scale
            ax.bar(x, vals, 0.6, bottom=bottom, label=k, color=palette(i))
            bottom += vals
        ax.set_xticks(x, labels, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(f"{unit} per device")
        ax.set_ylim(0, top * 1.08 if top > 0 else 1.0)
        ax.set_title(f"memory per device: {what}", fontsize=10)
    axs[0].legend(fontsize=8)
    groups = list(dict.fromkeys("+".join(a["mesh_axes"]) or "-" for r in reports.values()
                                for a in r["collectives_by_axes"]))
    ax = axs[2]
    if groups:
        sent = np.zeros((len(labels), len(groups)))
        bound = np.zeros(len(labels))
        for i, r in enumerate(reports.values()):
            for a in r["collectives_by_axes"]:
                sent[i, groups.index("+".join(a["mesh_axes"]) or "-")] += a["bytes"]
                bound[i] += a["lower_bound_bytes"]
        bscale, bunit = _unit(max(sent.sum(axis=1).max(), bound.max()))
        bottom = np.zeros(len(labels))
        for j, g in enumerate(groups):
            ax.bar(x, sent[:, j] / bscale, 0.6, bottom=bottom, label=g, color=palette(len(MEMORY_KEYS) + j))
            bottom += sent[:, j] / bscale
        ax.scatter(x, bound / bscale, marker="_", color="black", s=400, linewidths=2, zorder=3,
                   label="lower bound")
        ax.set_ylabel(f"{bunit} sent per device per step")
        highest = max(bottom.max(), bound.max() / bscale)
        ax.set_ylim(0, 1.35 * highest if highest > 0 else 1.0)  # room for the legend
        ax.legend(fontsize=8, title="mesh axes", title_fontsize=8, ncols=2)
    else:
        ax.text(0.5, 0.5, "no collectives", ha="center", va="center", transform=ax.transAxes)
    ax.set_xticks(x, labels, rotation=30, ha="right", fontsize=8)
    ax.set_title("collective bytes by mesh axes", fontsize=10)
    return fig


def scaling_row(strategy: str, report: dict) -> dict:
    """One point of a scaling plot from a report.plan dict: {strategy, devices,
    analytic_memory_bytes (formula total per device), compiled_memory_bytes (XLA's peak
    estimate per device on CPU), params/optimizer/gradients/activations_bytes (formulas),
    step_time_s, mfu (predicted on the report's hardware), collective_bytes}."""
    formula = report["analytic_memory_per_device_bytes"]
    row = {"strategy": strategy, "devices": int(report["devices"]),
           "analytic_memory_bytes": float(formula["total"]),
           "compiled_memory_bytes": float(report["memory_per_device_bytes"]["peak_estimate"]),
           "step_time_s": float(report["predicted_step_time_s"]),
           "mfu": float(report["predicted_mfu"]),
           "collective_bytes": float(report["collective_bytes_per_step"])}
    row.update({f"{k}_bytes": float(formula[k] or 0.0) for k in MEMORY_KEYS})
    return row


def scaling_figure(rows: Sequence[Mapping], memory_keys: Sequence[str] = ("analytic_memory_bytes",
                                                                        "compiled_memory_bytes")):
    """Memory per device and predicted step time against device count, one line per
    strategy, device count on a log-2 axis.

    rows: [{strategy: str, devices: int, step_time_s: float, and each of memory_keys:
          bytes per device}] (scaling_row makes them from report.plan dicts); points of one
          strategy are joined in order of devices
    memory_keys: one panel each (default: the formulas' total, the compiled CPU peak),
          then a panel of step_time_s in ms. Returns the Figure.
    """
    import matplotlib.pyplot as plt

    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    if not strategies:
        raise ValueError("scaling_figure needs at least one row")
    panels = list(memory_keys) + ["step_time_s"]
    fig, axs = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4), constrained_layout=True,
                            squeeze=False)
    axs = axs[0]
    scale, unit = _unit(max(float(r[k]) for r in rows for k in memory_keys) if memory_keys else 1)
    markers = "osD^vP*X"
    for i, s in enumerate(strategies):
        mine = sorted((r for r in rows if r["strategy"] == s), key=lambda r: r["devices"])
        xs = [r["devices"] for r in mine]
        for ax, key in zip(axs, panels):
            ys = [float(r[key]) * 1e3 if key == "step_time_s" else float(r[key]) / scale for r in mine]
            ax.plot(xs, ys, marker=markers[i % len(markers)], color=palette(i), label=s)
    devices = sorted({r["devices"] for r in rows})
    names = {"analytic_memory_bytes": "memory per device (formulas)",
             "compiled_memory_bytes": "memory per device (compiled, CPU)", "step_time_s": "predicted step time"}
    for ax, key in zip(axs, panels):
        ax.set_xscale("log", base=2)
        ax.set_xticks(devices, [str(d) for d in devices])
        ax.set_xlabel("devices")
        ax.set_ylabel("ms" if key == "step_time_s" else f"{unit} per device")
        ax.set_ylim(bottom=0)
        ax.set_title(names.get(key, key), fontsize=10)
        ax.grid(alpha=0.3)
    axs[0].legend(fontsize=8)
    return fig
