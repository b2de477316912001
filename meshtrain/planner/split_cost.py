"""The cost of a split that moves activations its own way: one protocol for all of them.

Data, FSDP, ZeRO and tensor parallelism are costed from the parameters' shardings
(planner/bounds.py). A split whose collectives carry activations instead (a spatial
layout's halo rows, context parallelism's k and v, expert parallelism's tokens) has a
module of its own that is a SplitCost, registered in bounds.SPLIT_COSTS under the key the
plan report gives its section:

    traffic(exp) -> Traffic | None       its formula, pass by pass; None: the layout does
                                         not make this split
    figures(exp, traffic, compiled) -> dict   its own figures beside the traffic (FLOPs,
                                         weights), `compiled` given or None

A Traffic's terms say which passes the least a step sends counts (`Traffic.bounds`, in
the lower-bound table) and which XLA sends beyond that for a reason of the model's
(`Traffic.excess`, named in the report); `report` sets it beside the compiled step's.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from meshtrain.planner import hlo


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


class SplitCost(Protocol):
    def traffic(self, exp) -> Traffic | None: ...
    def figures(self, exp, traffic: Traffic, compiled) -> dict: ...


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
    return {**out, **cost.figures(exp, t, compiled)}
