"""The costs of the splits whose collectives carry activations, one registry for all of
them, and the arithmetic every cost shares: where a logical dim is split, the rows a device
computes (docs/planner.md, "Splits that move activations").

Data, FSDP and ZeRO are costed from the parameters' shardings (planner/bounds.py). Megatron's
all-reduces over tensor and the pipeline's sends between stages (planner/bounds.py), a
spatial layout's halo rows (planner/halo.py), context parallelism's k and v
(planner/context.py) and expert parallelism's tokens (planner/experts.py) move activations
instead: each is a SplitCost in bounds.SPLIT_COSTS, under its plan report section's key.
A Traffic's terms say which passes the lower bound counts (`Traffic.bounds`) and which XLA
sends beyond it for a reason of the model's (`Traffic.excess`); `report` sets it beside the
compiled step's. The linter's <axis>-on-dcn bytes are the same Traffic's bound.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from meshtrain.parallel.layouts.rules import TARGETS
from meshtrain.planner import hlo



def group_size(shape, axes) -> int:
    """Devices in a group along mesh `axes` (`shape`: mesh axis -> size)."""
    return math.prod(shape[a] for a in axes)


def split_over(layout, shape, name: str, axes=None, target: str | None = "activations") -> tuple[int, tuple[str, ...]]:
    """(pieces, mesh axes of size > 1 in mesh order) the logical dim `name` of an array with
    logical `axes` (default: `name` alone; the other dims may claim mesh axes first) is split
    into by `layout`'s `target` table on a mesh of `shape`; target None: by any table."""
    axes = tuple(axes or (name,))
    over = {a for t in (TARGETS if target is None else (target,)) for a in layout.split(axes, name, shape, t)[1]}
    over = tuple(a for a in shape if a in over and shape[a] > 1)
    return group_size(shape, over), over


def local_batch(exp) -> dict:
    """Rows one device computes at a time: {"rows": per accumulation microbatch on a device
    outside the pipeline, "stage_rows": all pipeline microbatches a stage holds,
    "pipeline_rows": one pipeline microbatch, "tensor": heads split, "vocab": vocabulary
    split, "micro": microbatches a step runs through each layer (accumulation x pipeline)}."""
    cfg, pipe, shape = exp.cfg, exp.model.pipeline, exp.mesh.shape
    k, m = cfg.train.grad_accum_steps, (pipe.microbatches if pipe else 1)
    outer = split_over(exp.layout, shape, "batch")[0]
    inner = outer if pipe is None else split_over(exp.layout.without("stage"), shape, "batch")[0]
    return {"rows": cfg.train.batch_size // k // outer, "stage_rows": cfg.train.batch_size // k // inner,
            "pipeline_rows": cfg.train.batch_size // k // inner // m,
            "tensor": split_over(exp.layout, shape, "heads")[0], "vocab": split_over(exp.layout, shape, "vocab")[0],
            "micro": k * m}


@dataclasses.dataclass(frozen=True)
class Bound:
    """Bytes per device per step a split must send at the least, in `count` ops."""

    kind: str                    # the collective: "all-to-all", "collective-permute", ...
    mesh_axes: tuple[str, ...]
    count: int
    bytes: float
    what: str


@dataclasses.dataclass(frozen=True)
class Excess:
    """Bytes per device per step XLA sends beyond the bound, for a reason of the model's."""

    kind: str
    mesh_axes: tuple[str, ...]
    bytes: float
    why: str

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Term:
    """One pass of a split's traffic: `ops` collectives of `kind`, `bytes` per device per
    step; `note` is the bound row's `what` when `bound`, else the excess's `why`."""

    kind: str
    bytes: float
    ops: int
    bound: bool
    note: str


@dataclasses.dataclass
class Traffic:
    """A split's collectives by formula. `terms` by pass (forward, backward, recompute, ...);
    none when the split has no formula here (`not_counted` says why; `bytes` is None)."""

    mesh_axes: tuple[str, ...]
    split: int
    kinds: tuple[str, ...]  # the compiled collectives it is set beside
    terms: dict[str, Term] = dataclasses.field(default_factory=dict)
    not_counted: list[str] = dataclasses.field(default_factory=list)
    figures: dict = dataclasses.field(default_factory=dict)  # the split's own (block_bytes, convs, ...)
    counted: bool = True

    @property
    def bytes(self) -> float | None:
        return sum(t.bytes for t in self.terms.values()) if self.counted else None

    @property
    def count(self) -> int:
        return sum(t.ops for t in self.terms.values())

    @property
    def bound_bytes(self) -> float | None:
        return sum(t.bytes for t in self.terms.values() if t.bound) if self.counted else None

    def bounds(self) -> list[Bound]:
        """The bound's rows, one per collective kind of the passes it counts."""
        rows: dict[str, Bound] = {}
        for t in self.terms.values():
            if t.bound and t.bytes > 0:
                r = rows.get(t.kind)
                rows[t.kind] = Bound(t.kind, self.mesh_axes, t.ops + (r.count if r else 0),
                                     t.bytes + (r.bytes if r else 0.0), r.what if r else t.note)
        return list(rows.values())

    def excess(self) -> list[Excess]:
        return [Excess(t.kind, self.mesh_axes, t.bytes, t.note) for t in self.terms.values()
                if not t.bound and t.bytes > 0]

    def to_json(self) -> dict:
        bound = self.bound_bytes
        return {"mesh_axes": list(self.mesh_axes), "split": self.split, "bytes": self.bytes, "count": self.count,
                "terms": {p: t.bytes for p, t in self.terms.items()}, "ops": {p: t.ops for p, t in self.terms.items()},
                "bound_bytes": bound, "bound_count": sum(t.ops for t in self.terms.values() if t.bound),
                "not_counted": self.not_counted, **self.figures}


@dataclasses.dataclass(frozen=True)
class SplitCost:
    """One split's formula, `traffic(exp)` (None: the layout does not make the split), and
    where it has them its own figures beside the traffic, `figures(exp, traffic, compiled)`
    (FLOPs, weights; `compiled` given or None)."""

    traffic: Callable
    figures: Callable | None = None


def report(cost: SplitCost, exp, rows: list[dict], compiled=None) -> dict | None:
    """`cost`'s traffic (Traffic.to_json) beside the compiled step's collectives of its kinds
    over the same mesh axes (`rows`: hlo.collective_table): "compiled_bytes",
    "compiled_count", "ratio" (compiled / formula), "bound_ratio" (compiled / bound); with
    its own `figures`. None when the layout does not make the split."""
    t = cost.traffic(exp)
    if t is None:
        return None
    out = hlo.with_compiled(t.to_json(), rows, t.kinds)
    out["bound_ratio"] = out["compiled_bytes"] / out["bound_bytes"] if out["bound_bytes"] else None
    return {**out, **(cost.figures(exp, t, compiled) if cost.figures else {})}
