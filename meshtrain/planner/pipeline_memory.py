"""Activation memory of a pipelined step per schedule, by the formulas: the pipeline part
of planner/analytic.py's `activations`, from numbers analytic works out.

Per device, with S stages, M microbatches, v chunks per stage, an *item* = one microbatch
through one chunk of L/(v S) layers, R(n) = the bytes one layer keeps for its backward pass
for n rows at model.remat and X = one [mb, T, D] activation in the compute dtype: gpipe and
circular keep every item, L/S x R(M mb); 1f1b and interleaved K_s items of stage s
(pipeline_ticks.in_flight) in v K slots (pipeline_ticks.stash_slots), as chunk inputs
(v K X, one item's residuals recomputed) or residuals (v K x L/(v S) x R(mb)), plus
4 X of send buffers and 2 M X of embedded microbatches and their gradient; zb adds W's
stash, S items of L/(v S) x R_W(mb) (pipeline_ticks.weight_stash_slots). The table, the
loss head's share and why K_0 is min(M, 2S - 1): docs/planner.md, "Pipeline schedules".
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from meshtrain.parallel.pipeline import ticks as pipeline_ticks
from meshtrain.parallel.pipeline.scan import Pipeline

BUFFER_SLOTS = 4  # [mb, T, D] slots a stage keeps in the 1f1b loop: forward and backward sends
# Layer FLOPs of a step over gpipe's (forward 1 + backward 2): stash=inputs runs each
# chunk's forward again in its backward slot.
LAYER_FLOPS = {"inputs": 4 / 3, "residuals": 1.0}


@dataclasses.dataclass(frozen=True)
class Account:
    """One pipelined step's activations per device, and what sets them."""
    schedule: str
    stash: str | None         # 1f1b/interleaved only
    stages: int
    microbatches: int
    repeats: int
    kept: tuple[int, ...]     # [S]: the most items stage s keeps at once
    slots: int                # items the stash holds room for on a device (v K), or v M under gpipe
    item_layers: int          # layers in one item (a chunk): L/(v S)
    parts: dict               # {what: bytes per device}
    written: float            # bytes the step writes for its backward, all items (the roofline's traffic)

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    @property
    def bubble(self) -> float:
        return Pipeline(self.stages, self.microbatches, self.repeats, schedule=self.schedule).bubble

    def to_json(self) -> dict:
        return {"schedule": self.schedule, "stash": self.stash, "stages": self.stages,
                "microbatches": self.microbatches, "repeats": self.repeats, "bubble": self.bubble,
                "items_kept_per_stage": list(self.kept), "stash_slots": self.slots,
                "items_per_stage": self.repeats * self.microbatches,
                "layers_per_item": self.item_layers, "activation_parts_bytes": dict(self.parts),
                "activations_bytes": self.total}


@functools.lru_cache(maxsize=256)
def _in_flight(stages: int, microbatches: int, repeats: int, schedule: str) -> tuple[int, ...]:
    """pipeline_ticks.in_flight, once per shape: it walks every tick (the search asks often)."""
    pipe = Pipeline(stages=stages, microbatches=microbatches, repeats=repeats, schedule=schedule)
    return tuple(int(k) for k in pipeline_ticks.in_flight(pipe))


def items_kept(pipe: Pipeline) -> tuple[int, ...]:
    """[S]: the most items (one microbatch through one chunk) stage s keeps at once: all
    v M under gpipe/circular, pipeline_ticks.in_flight under 1f1b/interleaved."""
    if not pipe.one_f_one_b:
        return (pipe.repeats * pipe.microbatches,) * pipe.stages
    return _in_flight(pipe.stages, pipe.microbatches, pipe.repeats, pipe.schedule)


def stash_slots(pipe: Pipeline) -> int:
    """Items a device's stash holds room for: v x pipeline_ticks.stash_slots under
    1f1b/interleaved (slot (i, m mod K) of each repeat i), every item v M under gpipe."""
    if not pipe.one_f_one_b:
        return pipe.repeats * pipe.microbatches
    return pipe.repeats * _stash_slots(pipe.stages, pipe.microbatches, pipe.repeats, pipe.schedule)


@functools.lru_cache(maxsize=256)
def _stash_slots(stages: int, microbatches: int, repeats: int, schedule: str) -> int:
    return int(pipeline_ticks.stash_slots(Pipeline(stages=stages, microbatches=microbatches, repeats=repeats,
                                                   schedule=schedule)))


def account(pipe: Pipeline, num_layers: int, residuals: Callable[[int], float], recompute: float,
            mb_rows: int, stream: float, head_after: float, head_per_tick: float,
            weight_inputs: Callable[[int], float] | None = None) -> Account:
    """The activations of one step (module docstring). `residuals(rows)`: R, one layer at
    model.remat for `rows` rows on the device; `recompute`: one layer's full activations
    of one microbatch when model.remat recomputes, else 0; `mb_rows`: a microbatch's rows
    on the device; `stream`: X, bytes of one [mb, T, D] on the device; `head_after`: the
    loss head run after the pipeline (gpipe, circular); `head_per_tick`: run on each tick
    on one microbatch (1f1b, interleaved); `weight_inputs(rows)`: R_W, what one layer's W
    reads (zb)."""
    s, m, v = pipe.stages, pipe.microbatches, pipe.repeats
    kept = items_kept(pipe)
    item_layers = num_layers // (v * s)
    every = num_layers // s * residuals(m * mb_rows)  # every item's residuals: what gpipe keeps
    if not pipe.one_f_one_b:
        parts = {"residuals": every, "recompute": recompute, "head": head_after}
        stash = None
    else:
        k, one_item = stash_slots(pipe), item_layers * residuals(mb_rows)
        parts = ({"stash": k * stream, "residuals": one_item} if pipe.stash == "inputs" else
                 {"stash": k * one_item})
        if pipe.schedule == "zb":
            parts["weight stash"] = pipeline_ticks.weight_stash_slots(pipe) * item_layers * weight_inputs(mb_rows)
        parts.update(recompute=recompute, buffers=BUFFER_SLOTS * stream, inputs=2 * m * stream, head=head_per_tick)
        stash = pipe.stash
    return Account(pipe.schedule, stash, s, m, v, kept, stash_slots(pipe), item_layers, parts,
                   written=every + recompute + head_after)
