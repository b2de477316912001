"""Pipeline parallelism as scan-over-stages (GPipe and circular), in one SPMD program.

The layer stack is cut into S = mesh `stage` stages. Block parameters are stored
`[S, L/S, ...]` with logical axes `("stage", "layers", ...)`, so the layout puts
stage s's layers on the devices at position s of the `stage` mesh axis. The model
code is unchanged: it hands its layer function to `run_layers`, which runs every
stage at once with `vmap` over the stage axis and moves activations between
stages with `jnp.roll` (a collective-permute). Backward comes from autodiff.

With `repeats` = r > 1 (circular schedule) the stack is cut into r*S chunks of
Lc = L/(r*S) layers; chunk v = i*S + s (repeat i, stage s) lives on stage s, so a
device holds r non-adjacent chunks and a microbatch goes round the stages r times.

The schedule, for M microbatches in groups of S (r = 1 is GPipe, any M):

    buf = zeros[S, mb, T, D]                       # one microbatch slot per stage
    for t in range(r*M + S - 1):                   # lax.scan over ticks
        for s in stages, at once (vmap):
            w = t - s                              # work items stage s has started
            g, i, j = w // (r*S), (w // S) % r, w % S
            m = g*S + j                            # microbatch, in repeat i
            x = input[m] if (s == 0 and i == 0) else buf[s - 1 mod S]   # the roll
            buf[s] = chunk(i*S + s)(x)             # bubble when w < 0 or w >= r*M
        out[m] = buf[S-1]  when stage S-1 finished repeat r-1 of microbatch m

Stage s-1's output of item w arrives at stage s one tick later with the same w;
stage S-1's output of repeat i wraps to stage 0 exactly S ticks after it left
it, as repeat i+1 of the same microbatch: why M must be a multiple of S when
r > 1. Bubble ticks compute on zeros and their results are never read. Of the
r*M + S - 1 ticks each stage is idle S - 1, so the wasted fraction of the
pipelined work is (S - 1) / (r*M + S - 1).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from meshtrain.errors import UserError
from meshtrain.parallel.layouts import PIPELINE_PRESETS
from meshtrain.parallel.layouts.rules import TARGETS, Layout, mesh_axes_of

SCHEDULES = ("gpipe", "circular", "1f1b", "interleaved", "zb")
# What the backward slot of 1f1b/interleaved/zb keeps per item (meshtrain/parallel/pipeline/schedule_1f1b.py):
# "inputs" recomputes the chunk from its stashed input; "residuals" keeps autodiff's.
STASHES = ("inputs", "residuals")
# How zb splits a chunk's backward (meshtrain/parallel/pipeline/split_backward.py): "jaxpr"
# splits each layer's pullback, every equation once; "two_vjps" takes one pullback for the
# input gradient and another for the weights', the cotangent chain twice.
SPLITS = ("jaxpr", "two_vjps")


@dataclasses.dataclass(frozen=True)
class Pipeline:
    stages: int        # S: size of the `stage` mesh axis
    microbatches: int  # M: microbatches per pipelined batch
    repeats: int = 1   # r: chunks per stage (1: GPipe/1F1B, >1: circular/interleaved)
    # Benchmarks unroll the tick loop so that cost_analysis counts every tick.
    unroll: bool = False
    schedule: str = "gpipe"
    stash: str = "inputs"  # 1f1b/interleaved/zb only: see STASHES
    split: str = "jaxpr"   # zb only: see SPLITS

    @property
    def one_f_one_b(self) -> bool:
        """Whether the backward runs in the tick loop (1f1b, interleaved, zb) rather than by
        autodiff through the forward ticks (gpipe, circular)."""
        return self.schedule in ("1f1b", "interleaved", "zb")

    @property
    def ticks(self) -> int:
        """Forward ticks: the whole step of gpipe/circular, the forward-only pass (eval) of
        1f1b/interleaved (whose step takes pipeline_ticks.phases)."""
        return self.repeats * self.microbatches + self.stages - 1

    @property
    def bubble(self) -> float:
        """Fraction of the pipelined work that is idle (wasted in this SPMD form); under zb
        with F = B = W (tests/test_pipeline_zb.py counts it tick by tick)."""
        if self.schedule == "zb":
            return 2 * (self.stages - 1) / (3 * self.repeats * self.microbatches + 2 * (self.stages - 1))
        return (self.stages - 1) / self.ticks


def from_config(p, stages: int, num_layers: int, layout: Layout | None = None) -> Pipeline | None:
    """cfg.pipeline and the mesh's `stage` size -> a Pipeline, or None when off.

    The pipeline is on when pipeline.microbatches > 0; a `stage` axis > 1 needs it,
    unless `layout` puts nothing on `stage` (its devices then repeat the same work, as
    on any mesh axis a layout leaves unused: how the same config is run unpipelined).
    """
    if p.schedule not in SCHEDULES:
        raise UserError(f"pipeline.schedule={p.schedule!r}: choose one of {', '.join(SCHEDULES)}.")
    m, r = p.microbatches, p.repeats
    if m < 0 or r < 1:
        raise UserError(f"pipeline.microbatches={m} and pipeline.repeats={r}: microbatches must be "
                        f">= 0 (0 turns the pipeline off) and repeats >= 1.")
    if m == 0:
        if stages > 1 and (layout is None or uses_stage(layout)):
            raise UserError(
                f"The mesh has stage={stages} but pipeline.microbatches=0 (pipeline off). Set "
                f"pipeline.microbatches=M, e.g. M={4 * stages}: the bubble is (S-1)/(M+S-1) = "
                f"{(stages - 1) / (5 * stages - 1):.1%} at M = 4 x S.")
        return None
    stash, split = p.get("stash", "inputs"), p.get("split", "jaxpr")
    if stash not in STASHES:
        raise UserError(f"pipeline.stash={stash!r}: choose one of {', '.join(STASHES)} (what the "
                        f"backward slot of 1f1b/interleaved/zb keeps, docs/pipeline.md).")
    if split not in SPLITS:
        raise UserError(f"pipeline.split={split!r}: choose one of {', '.join(SPLITS)} (how zb splits a "
                        f"chunk's backward into input and weight gradients, docs/pipeline.md).")
    one_chunk = {"gpipe": "circular", "1f1b": "interleaved"}
    if p.schedule in one_chunk and r != 1:
        raise UserError(f"pipeline.repeats={r} needs pipeline.schedule={one_chunk[p.schedule]} "
                        f"({p.schedule} runs each stage's layers as one chunk).")
    if p.schedule in ("circular", "interleaved") and r < 2:
        plain = {v: k for k, v in one_chunk.items()}[p.schedule]
        raise UserError(f"pipeline.schedule={p.schedule} with pipeline.repeats={r} is {plain}; set "
                        f"pipeline.repeats >= 2 (chunks per stage) or use schedule={plain}.")
    if num_layers % (stages * r):
        raise UserError(
            f"model.num_layers={num_layers} is not divisible by stages x repeats = {stages} x {r} "
            f"= {stages * r}: each of the {stages * r} chunks must hold the same number of layers. "
            f"Use a layer count that is a multiple of {stages * r}, or change the stage axis or "
            f"pipeline.repeats.")
    if r > 1 and m % stages:
        raise UserError(
            f"pipeline.microbatches={m} is not a multiple of stage={stages}: the {p.schedule} schedule "
            f"sends microbatches round the stages in groups of S. Use M = "
            f"{-(-m // stages) * stages} (or pipeline.repeats=1).")
    return Pipeline(stages=stages, microbatches=m, repeats=r, schedule=p.schedule, stash=stash, split=split)


def uses_stage(layout: Layout) -> bool:
    """Whether any of the layout's tables puts a logical axis on the `stage` mesh axis."""
    return any("stage" in axes for target in TARGETS for _, axes in layout.rules(target))


def check_layout(layout: Layout, pipe: Pipeline | None) -> None:
    """A pipelined run needs the params' `stage` dim on the `stage` mesh axis in every table."""
    if pipe is None:
        return
    for target in TARGETS:
        if mesh_axes_of(layout.spec(("stage",), target)[0]) != ("stage",):
            raise UserError(
                f"Layout {layout.name!r} does not put the logical axis 'stage' on the mesh axis "
                f"'stage' in its {target} rules, but the run is pipelined (pipeline.microbatches="
                f"{pipe.microbatches}). Use a pipeline layout ({', '.join(PIPELINE_PRESETS)}) "
                f"or begin every table with 'stage:stage'.")


def warnings_for(pipe: Pipeline | None) -> list[str]:
    if pipe is None or pipe.microbatches >= pipe.stages:
        return []
    formula = "2(S-1)/(3rM+2(S-1))" if pipe.schedule == "zb" else "(S-1)/(r*M+S-1)"
    more = dataclasses.replace(pipe, microbatches=4 * pipe.stages)
    return [f"pipeline.microbatches={pipe.microbatches} < stage={pipe.stages}: the bubble "
            f"{formula} = {pipe.bubble:.0%} of the pipelined work dominates; use M >= "
            f"{4 * pipe.stages} (bubble {more.bubble:.0%})."]


# --- storage: [L, ...] in model layer order <-> [S, L/S, ...] in stage order -------------

def to_stages(blocks, pipe: Pipeline):
    """Model-ordered stacks [L, ...] -> [S, r*Lc, ...]; row (s, i*Lc + k) is layer (i*S + s)*Lc + k."""
    s, r = pipe.stages, pipe.repeats

    def one(a):
        lc = a.shape[0] // (s * r)
        return a.reshape(r, s, lc, *a.shape[1:]).swapaxes(0, 1).reshape(s, r * lc, *a.shape[1:])
    return jax.tree.map(one, blocks)


def from_stages(blocks, pipe: Pipeline):
    """The inverse of `to_stages`: [S, r*Lc, ...] -> [L, ...] in model layer order."""
    s, r = pipe.stages, pipe.repeats

    def one(a):
        lc = a.shape[1] // r
        return a.reshape(s, r, lc, *a.shape[2:]).swapaxes(0, 1).reshape(s * r * lc, *a.shape[2:])
    return jax.tree.map(one, blocks)


def stage_axes(axes: tuple) -> tuple:
    """("layers", ...) -> ("stage", "layers", ...)."""
    assert axes[0] == "layers", axes
    return ("stage", *axes)


def stage_shape(shape: jax.ShapeDtypeStruct, pipe: Pipeline) -> jax.ShapeDtypeStruct:
    n, *rest = shape.shape
    return jax.ShapeDtypeStruct((pipe.stages, n // pipe.stages, *rest), shape.dtype)


# --- the schedule --------------------------------------------------------------------

def schedule(pipe: Pipeline, t, xp=jnp):
    """Tick t -> per stage [S]: (valid, repeat i, microbatch m) of the item it runs.

    `xp` is jnp inside the step, np for tables and tests.
    """
    s, r, m = pipe.stages, pipe.repeats, pipe.microbatches
    w = t - xp.arange(s)
    valid = (w >= 0) & (w < r * m)
    w = xp.clip(w, 0, r * m - 1)
    return valid, (w // s) % r, (w // (r * s)) * s + w % s


def schedule_table(pipe: Pipeline) -> str:
    """The schedule as text: a row per tick, a column per stage, `m` or `m.i` (repeat i)
    for the microbatch a stage runs, `.` for a bubble."""
    rows = [(" tick | " + " ".join(f"s{s:<4}" for s in range(pipe.stages))).rstrip()]
    for t in range(pipe.ticks):
        valid, i, m = schedule(pipe, t, np)
        cells = [(f"{mm}" if pipe.repeats == 1 else f"{mm}.{ii}") if v else "." for v, ii, mm in zip(valid, i, m)]
        rows.append((f"{t:5d} | " + " ".join(f"{c:<5}" for c in cells)).rstrip())
    return "\n".join(rows)


def output_ticks(pipe: Pipeline) -> np.ndarray:
    """[M]: the tick at which stage S-1 finishes microbatch m's last repeat."""
    s, r = pipe.stages, pipe.repeats
    m = np.arange(pipe.microbatches)
    return s - 1 + (m // s) * r * s + (r - 1) * s + m % s
