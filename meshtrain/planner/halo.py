"""The halo exchanges of a spatial layout, by formula, beside the compiled step's.

A layout that splits `height` over mesh axes of total size s (the dp_spatial preset:
height over `tensor`) gives each device h/s consecutive rows of every image activation.
XLA's SPMD partitioner runs each conv on the local rows and fetches the rows its window
reaches across a split boundary from the neighbouring device: one collective-permute per
direction. For a conv of kernel k, stride t and k//2 = p rows of zero padding (models/conv.py),
the rows a device needs from the device above it (which sends its last rows down) and
from the one below (which sends its first rows up) are, per pass of the train step:

    forward          x (the conv's input)      above p             below max(0, k-1-p-(t-1))
    input gradient   dy (its output gradient)  above (k-1-p)//t    below ceil(p/t)
    weight gradient  x again                   as forward

(k = 3, t = 1: one row each way in every pass; k = 3, t = 2: forward one row from above,
input gradient one row from below; a 1x1 conv, strided or not, none.) The forward needs
x's halo to compute its first and last rows; the input gradient is a conv of dy with the
flipped kernel (dilated by t), which needs dy's rows across the boundary; the weight
gradient sums x x dy over the device's output rows, whose windows reach the same rows of
x as the forward's did. The first conv of a model reads the images, which have no
gradient: it has no input-gradient exchange.

Each row is b x w x c x bytes: b the images a device holds per step (all of its
microbatches), w the width of the exchanged array (x's for forward and weight gradient,
the output's for the input gradient), c its channels on the device (the conv's in or out
channels over the shards of their logical name: a layout may split channels too), bytes
the compute dtype's (model.dtype: XLA exchanges the conv's input as the conv reads it, so
the first conv's halo is the normalised image in the compute dtype, not the uint8 pixels).
Per device, as the planner's other collectives (planner/hlo.py): of the s devices in a
group, s - 1 send in each direction, so

    bytes each device sends = (s - 1)/s x (above + below) x row bytes

summed over convs and passes; one op per direction with rows to send.

What XLA sends (the HLO of the real train step, vgg_tiny_dp2_spatial4 and VGG-16 at
224 px, ResNet tiny under dp_spatial; docs/planner.md "Spatial layouts"): exactly these
rows, dtype and direction for every conv, strided ones included. Of the three terms, the
weight gradient's is XLA's choice, not a need: the forward already received those rows,
and a program that kept them (k//2 rows per boundary: small) would not send them again.
XLA partitions the weight-gradient conv on its own, from the residual x autodiff saved
(the local rows alone), and fetches the halo again. `least` is the formula without it;
the lower-bound table uses it, and names the weight-gradient term as known excess.

Not in the formula: pools (VGG's 2x2 pools of stride 2 need no rows while the local
height is even; an odd local height, as VGG-16's 14-row features split 2 ways, makes the
windows straddle the boundary and XLA moves rows for the pool forward and backward), and
splits of `width` (columns and corners, not counted: the report says so).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from meshtrain.planner import hlo
from meshtrain.planner.split_cost import Bound, Excess

PASSES = ("forward", "input gradient", "weight gradient")
# The passes a step needs at the least: the weight gradient could reuse the forward's rows.
LEAST = ("forward", "input gradient")


@dataclasses.dataclass(frozen=True)
class Exchange:
    """One conv's halo in one pass: rows from the device above and below, bytes a row."""

    conv: str
    pass_: str
    above: int
    below: int
    row_bytes: float  # b x w x c x bytes of one row of the exchanged array

    @property
    def ops(self) -> int:
        return (self.above > 0) + (self.below > 0)

    def per_device(self, s: int) -> float:
        """Bytes each device of a group of s sends for this exchange (module docstring)."""
        return (s - 1) / s * (self.above + self.below) * self.row_bytes

    def to_json(self, s: int) -> dict:
        return {"conv": self.conv, "pass": self.pass_, "rows_above": self.above, "rows_below": self.below,
                "row_bytes": self.row_bytes, "bytes": self.per_device(s)}


def halo_rows(k: int, stride: int, pass_: str) -> tuple[int, int]:
    """(rows from the device above, rows from the device below) a conv of kernel k and
    stride `stride`, padded k//2 each side, needs in `pass_` (module docstring)."""
    p = k // 2
    if pass_ == "input gradient":
        return (k - 1 - p) // stride, -(-p // stride)
    return p, max(0, k - 1 - p - (stride - 1))


def exchanges(convs, images: int, dtype_bytes: int, channel_shards=lambda name: 1,
              width_shards: int = 1) -> list[Exchange]:
    """Every conv's exchange in every pass with rows to send, for `images` images per
    device, `channel_shards(logical name)` pieces of a feature dim, `width_shards` of the
    width. `convs`: models.conv.ConvSpec in forward order."""
    out = []
    for c in convs:
        for pass_ in PASSES:
            if pass_ == "input gradient" and c.axes[0] == "image_channels":
                continue  # the images have no gradient
            above, below = halo_rows(c.k, c.stride, pass_)
            if above + below == 0:
                continue
            dy = pass_ == "input gradient"
            width = (c.h_out if dy else c.h_in) / width_shards
            channels = c.c_out / channel_shards(c.axes[1]) if dy else c.c_in / channel_shards(c.axes[0])
            out.append(Exchange(c.name, pass_, above, below, images * width * channels * dtype_bytes))
    return out


def spatial_axes(exp) -> tuple[str, ...]:
    """The mesh axes (of size > 1) the layout splits image rows or columns over."""
    names = ("height", "width")
    return tuple(dict.fromkeys(a for n in names for a in exp.layout.shards(n, exp.mesh.shape)[1]
                               if exp.mesh.shape[a] > 1))


def conv_paths(exp) -> tuple[str, ...]:
    """The param path prefixes of the convs (`name/`): their leaves' gradients are sums over
    the image rows, so a spatial split leaves each device a part to reduce."""
    convs = exp.model.family.convs
    return () if convs is None else tuple(c.name + "/" for c in convs(exp.model.cfg))


def formula(exp) -> dict | None:
    """The halo formula for a built Experiment: None when the layout splits no image rows;
    else {"mesh_axes", "split", "bytes", "count", "terms": {pass: bytes}, "least_bytes",
    "least_count", "convs": [Exchange.to_json], "not_counted": [reasons]}, bytes per device
    per step. "bytes" None (with the reason in "not_counted") for a family without convs."""
    mesh, layout = exp.mesh, exp.layout
    split, axes = layout.shards("height", mesh.shape)
    width_split, width_axes = layout.shards("width", mesh.shape)
    if split == 1 and width_split == 1:
        return None
    out = {"mesh_axes": list(axes), "split": split, "bytes": None, "count": 0, "terms": {},
           "least_bytes": None, "least_count": 0, "convs": [], "not_counted": []}
    family = exp.model.family
    if family.convs is None:
        out["not_counted"].append(f"model family {family.name!r} lists no convs (Family.convs): no halo formula")
        return out
    if width_split > 1:
        out["not_counted"].append(f"width split {width_split} ways over {'+'.join(width_axes)}: its column "
                                  f"(and corner) halos are not in the formula, which counts rows")
        if split == 1:
            return out
    cfg = exp.model.cfg
    images = exp.cfg.train.batch_size // layout.shards("batch", mesh.shape)[0]
    found = exchanges(family.convs(cfg), images, jnp.dtype(cfg.dtype).itemsize,
                      lambda name: layout.shards(name, mesh.shape)[0], width_split)
    out["convs"] = [e.to_json(split) for e in found]
    out["terms"] = {p: sum(e.per_device(split) for e in found if e.pass_ == p) for p in PASSES}
    out["bytes"] = sum(out["terms"].values())
    out["count"] = sum(e.ops for e in found)
    out["least_bytes"] = sum(out["terms"][p] for p in LEAST)
    out["least_count"] = sum(e.ops for e in found if e.pass_ in LEAST)
    odd = [c.name for c in family.convs(cfg) if (c.h_out // split) % 2 and c.h_out // split > 1]
    if odd:
        out["not_counted"].append(f"pools: {', '.join(odd)} leave an odd local height; a 2x2 pool of stride 2 "
                                  f"after one straddles the split boundary and XLA moves rows for it, forward "
                                  f"and backward, that the formula does not count")
    return out


def report(exp, rows: list[dict], compiled=None) -> dict | None:
    """`formula(exp)` with the compiled step's collective-permutes over the same mesh axes
    (`rows`: hlo.collective_table): "compiled_bytes", "compiled_count", "ratio" (compiled /
    formula) and "least_ratio" (compiled / least)."""
    f = formula(exp)
    if f is None:
        return None
    hlo.with_compiled(f, rows, ("collective-permute",))
    f["least_ratio"] = f["compiled_bytes"] / f["least_bytes"] if f["least_bytes"] else None
    return f


def bound_rows(exp) -> list[Bound]:
    """The halo's lower bound: the forward's and the
    input gradient's rows (`LEAST`)."""
    f = formula(exp)
    if f is None or not f["least_bytes"]:
        return []
    return [Bound("collective-permute", tuple(f["mesh_axes"]), f["least_count"], f["least_bytes"],
                  "halo exchange: k//2 rows of each conv's input forward and of its output gradient backward")]


def known_excess(exp) -> list[Excess]:
    """The weight gradient's halo, which XLA sends again (module docstring)."""
    f = formula(exp)
    if f is None or not f["terms"].get("weight gradient"):
        return []
    return [Excess("collective-permute", tuple(f["mesh_axes"]), f["terms"]["weight gradient"],
                   "each conv's weight gradient fetches x's halo rows again: XLA partitions it on its own "
                   "from the saved local rows rather than keep the forward's halo (planner/halo.py)")]
