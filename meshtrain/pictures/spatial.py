"""Pictures of a spatial layout for the notebooks (notebooks/layouts.ipynb): which device
holds which rows of an image activation [B, H, W, C] split by height, and the halo rows
each device receives from its neighbours for the conv that reads it.

  row_spans(shape, sharding)              an image's row spans and the devices holding them
  rows_picture(ax, shape, sharding, halo) one activation: rows by device, each piece with
                                          the k//2 halo rows it receives (or zero padding)
  rows_figure(exp, halos)                 those for an Experiment's image activations

As in pictures/__init__.py, matplotlib is imported inside the functions and no backend is chosen.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from meshtrain.pictures import format_ids, mesh_caption, palette, shard_blocks, sharding_picture


def row_spans(shape: Sequence[int], sharding, example: int = 0) -> list[tuple[int, int, list[int]]]:
    """[(first row, end row, device ids)] of example `example` of an image activation
    [B, H, W, C] (dim 1 is the rows), top to bottom; a row span held by several devices
    (replicas, or pieces of width or channels) lists them all."""
    spans: dict[tuple[int, int], set[int]] = {}
    for block, ids in shard_blocks(shape, sharding).items():
        if block[0][0] <= example < block[0][1]:
            spans.setdefault(block[1], set()).update(ids)
    return [(r0, r1, sorted(ids)) for (r0, r1), ids in sorted(spans.items())]


def rows_picture(ax, shape: Sequence[int], sharding, halo: int, example: int = 0,
                 title: str | None = None, colors: dict | None = None):
    """Draws which devices hold which rows of one image of an activation [B, H, W, C]
    split by rows (a spatial layout), and what a k x k conv reading it needs: the
    halo = k//2 rows above and below each device's piece, which the compiled step receives
    from the neighbouring devices (collective-permutes), or zero padding at the image edge.

    Left, the image (W wide): its row spans coloured by the devices that hold them. Right,
    one column per span: its own rows (solid), the halo rows it receives (hatched, in the
    sender's colour) and the padding rows (grey). Patches carry a gid: "rows" (left),
    "own", "halo", "pad". `colors` as in sharding_picture. Returns ax.
    """
    from matplotlib.patches import Rectangle

    shape = tuple(int(n) for n in shape)
    h, w = shape[1], shape[2]
    spans = row_spans(shape, sharding, example)
    colors = {} if colors is None else colors
    for _, _, ids in spans:
        colors.setdefault(tuple(ids), palette(len(colors)))
    owner = {r: tuple(ids) for r0, r1, ids in spans for r in range(r0, r1)}
    col_w, gap = max(w / 2, 2.0), max(w / 8, 1.0)

    def box(x, y, width, height, gid, color, text=None, **kw):
        ax.add_patch(Rectangle((x, y), width, height, facecolor=color, edgecolor="black",
                               linewidth=0.8, gid=gid, **kw))
        if text:
            ax.text(x + width / 2, y + height / 2, text, ha="center", va="center", fontsize=7, clip_on=True)

    for r0, r1, ids in spans:
        box(0, r0, w, r1 - r0, "rows", colors[tuple(ids)], format_ids(ids))
    for j, (r0, r1, ids) in enumerate(spans):
        x = w + gap + j * (col_w + gap)
        box(x, r0, col_w, r1 - r0, "own", colors[tuple(ids)], format_ids(ids))
        for rows in (range(r0 - halo, r0), range(r1, r1 + halo)):
            # Runs of consecutive halo rows with one sender (or padding, outside the image).
            runs: list[list] = []
            for r in rows:
                who = owner.get(r, "pad")
                if runs and runs[-1][0] == who:
                    runs[-1][2] = r + 1
                else:
                    runs.append([who, r, r + 1])
            for who, a, b in runs:
                if who == "pad":
                    box(x, a, col_w, b - a, "pad", "0.85", "pad")
                else:
                    box(x, a, col_w, b - a, "halo", colors[who], f"from {format_ids(who)}", hatch="///", alpha=0.5)
    ax.axvline(w + gap / 2, color="black", linewidth=0.5, linestyle=":")
    ax.set_xlim(0, w + gap + len(spans) * (col_w + gap))
    ax.set_ylim(h + halo, -halo)
    ax.set_xticks([w / 2] + [w + gap + j * (col_w + gap) + col_w / 2 for j in range(len(spans))],
                  [f"width {w}"] + [f"dev {format_ids(ids)}" for _, _, ids in spans], fontsize=7, rotation=30)
    ax.set_ylabel(f"rows (height {h})", fontsize=8)
    ax.tick_params(labelsize=7)
    head = f"{title} {list(shape)}" if title else f"{list(shape)}"
    ax.set_title(f"{head}, example {example}\nrows by device; each piece + {halo} halo row(s) each side",
                 fontsize=8)
    return ax


def rows_figure(exp, halos: Mapping[str, int], example: int = 0, title: str | None = None,
                cell: tuple[float, float] = (3.6, 3.4)):
    """One rows_picture per image activation of an Experiment under a spatial layout.

    exp:    a built Experiment of an image family (nothing compiled or allocated)
    halos:  {activation name (as the family's activations(cfg, b) names it, e.g. "images",
            "conv1 out"): halo rows (k//2 of the conv that reads it)}, in the order to draw
    The first panel is the first activation's sharding_picture (batch x height blocks:
    which device holds which images' which rows). Colours are shared. Returns the Figure.
    """
    import matplotlib.pyplot as plt
    from jax.sharding import NamedSharding

    found = {what: (shape, axes) for what, shape, axes in
             exp.model.family.activations(exp.model.cfg, exp.cfg.train.batch_size)}
    unknown = [n for n in halos if n not in found]
    if unknown:
        raise KeyError(f"no activation {', '.join(unknown)}; the activations are {', '.join(found)}")
    fig, axs = plt.subplots(1, len(halos) + 1, figsize=(cell[0] * (len(halos) + 1), cell[1]),
                            squeeze=False, constrained_layout=True)
    colors: dict = {}
    names = list(halos)
    sharding = {n: NamedSharding(exp.mesh, exp.layout.spec(found[n][1], "activations")) for n in names}
    sharding_picture(axs[0, 0], found[names[0]][0], sharding[names[0]], title=names[0],
                     dim_names=found[names[0]][1], colors=colors)
    for ax, n in zip(axs[0, 1:], names):
        rows_picture(ax, found[n][0], sharding[n], halos[n], example, title=n, colors=colors)
    head = f"{title}: " if title else ""
    fig.suptitle(f"{head}activations under layout {exp.layout.name}\n{mesh_caption(exp.mesh)}", fontsize=10)
    return fig
