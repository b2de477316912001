"""The cost of a split that moves activations its own way: one protocol for all of them.

Data, FSDP, ZeRO and tensor parallelism are costed from the parameters' shardings
(planner/bounds.py). A split whose collectives carry activations instead (a spatial
layout's halo rows, context parallelism's k and v, expert parallelism's tokens) has a
module of its own that is a SplitCost, registered in bounds.SPLIT_COSTS under the key the
plan report gives its section:

    report(exp, rows, compiled=None) -> dict | None
        its formula (None: the layout does not make this split) beside the compiled
        step's collectives (`rows`: hlo.collective_table) and, given `compiled`, its FLOPs
    bound_rows(exp) -> [Bound]      what the least a step sends counts of it
    known_excess(exp) -> [Excess]   what XLA sends beyond that, and why
"""

from __future__ import annotations

import dataclasses
from typing import Protocol


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


class SplitCost(Protocol):
    def report(self, exp, rows: list[dict], compiled=None) -> dict | None: ...
    def bound_rows(self, exp) -> list[Bound]: ...
    def known_excess(self, exp) -> list[Excess]: ...
