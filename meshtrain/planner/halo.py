"""The halo exchanges of a spatial layout, by formula (docs/planner.md, "Spatial layouts:
halo exchanges", derives it and sets it beside the compiled step's).

With `height` split s ways, each conv of kernel k, stride t and k//2 = p rows of padding
fetches from the devices above and below, one collective-permute per direction and pass:

    forward          x (the conv's input)      above p             below max(0, k-1-p-(t-1))
    input gradient   dy (its output gradient)  above (k-1-p)//t    below ceil(p/t)
    weight gradient  x again                   as forward (known excess: XLA fetches the
                                               forward's rows again; the bound leaves it out)

    a row            b x w x c x bytes: the images a device holds per step, the exchanged
                     array's width, its channels on the device, the compute dtype's bytes
    bytes each device sends = (s - 1)/s x (above + below) x row bytes, summed over convs
    and passes; one op per direction with rows to send

The first conv reads the images, which have no gradient. Not counted: pools whose windows
straddle a boundary (an odd local height), and splits of `width`.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from meshtrain.planner.split_cost import Term, Traffic, split_over

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
    return tuple(dict.fromkeys(a for n in ("height", "width") for a in split_over(exp.layout, exp.mesh.shape, n)[1]))


def conv_paths(exp) -> tuple[str, ...]:
    """The param path prefixes of the convs (`name/`): their leaves' gradients are sums over
    the image rows, so a spatial split leaves each device a part to reduce."""
    convs = exp.model.family.convs
    return () if convs is None else tuple(c.name + "/" for c in convs(exp.model.cfg))


BOUND = "halo exchange: k//2 rows of each conv's input forward and of its output gradient backward"
EXCESS = ("each conv's weight gradient fetches x's halo rows again: XLA partitions it on its own from the saved "
          "local rows rather than keep the forward's halo (planner/halo.py)")


def traffic(exp) -> Traffic | None:
    """The halo formula for a built Experiment, a Traffic of the PASSES (the weight
    gradient's known excess) with figures {"convs": [Exchange.to_json]}; None when the
    layout splits no image rows; not counted for a family without convs."""
    mesh, layout = exp.mesh, exp.layout
    split, axes = split_over(layout, mesh.shape, "height")
    width_split, width_axes = split_over(layout, mesh.shape, "width")
    if split == 1 and width_split == 1:
        return None
    out = Traffic(tuple(axes), split, ("collective-permute",), figures={"convs": []})
    family = exp.model.family
    if family.convs is None:
        out.not_counted.append(f"model family {family.name!r} lists no convs (Family.convs): no halo formula")
        out.counted = False
        return out
    if width_split > 1:
        out.not_counted.append(f"width split {width_split} ways over {'+'.join(width_axes)}: its column "
                               f"(and corner) halos are not in the formula, which counts rows")
        if split == 1:
            out.counted = False
            return out
    cfg = exp.model.cfg
    images = exp.cfg.train.batch_size // split_over(layout, mesh.shape, "batch")[0]
    found = exchanges(family.convs(cfg), images, jnp.dtype(cfg.dtype).itemsize,
                      lambda name: split_over(layout, mesh.shape, name)[0], width_split)
    out.figures["convs"] = [e.to_json(split) for e in found]
    for p in PASSES:
        mine = [e for e in found if e.pass_ == p]
        out.terms[p] = Term("collective-permute", sum(e.per_device(split) for e in mine), sum(e.ops for e in mine),
                            p in LEAST, BOUND if p in LEAST else EXCESS)
    odd = [c.name for c in family.convs(cfg) if (c.h_out // split) % 2 and c.h_out // split > 1]
    if odd:
        out.not_counted.append(f"pools: {', '.join(odd)} leave an odd local height; a 2x2 pool of stride 2 "
                               f"after one straddles the split boundary and XLA moves rows for it, forward "
                               f"and backward, that the formula does not count")
    return out
