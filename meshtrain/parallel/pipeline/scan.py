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
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from meshtrain.errors import UserError
from meshtrain.models.stack import run_stack
from meshtrain.parallel import grad_reduce
from meshtrain.parallel.hook import Constrain
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
        with F = B = W (pipeline_ticks.idle_share counts it tick by tick)."""
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


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """How the stages run on the mesh: shared by the forward-only schedules' runner here
    and the 1F1B tick loop (meshtrain/parallel/pipeline/schedule_1f1b.py).

    Two vmaps make the per-device program explicit: over stages (mesh axis `stage`)
    and over the n batch shards of a microbatch (`shard`: the mesh axes the layout
    splits `batch` over inside a stage, e.g. data+fsdp). The layers see `inner`, the
    layout without those mesh axes; the vmaps put them back.
    """
    pipe: Pipeline
    layout: Layout
    mesh: Mesh
    blocks_axes: object
    grads_pins: object
    n_shards: int
    shard: tuple[str, ...] | None
    inner: Layout

    def sharding(self, *spec) -> NamedSharding:
        return NamedSharding(self.mesh, P(*spec))

    def slot_spec(self) -> NamedSharding:
        """[S, mb, T, D]: one microbatch slot per stage."""
        btd = self.inner.spec(("batch", "length", "embed"), "activations")
        return self.sharding("stage", self.shard, *btd[1:])

    def inputs(self, x_btd: jax.Array) -> jax.Array:
        """x [B, T, D] -> [S, M, mb, T, D], zero but in stage 0's slot. Row i*M + j goes to
        microbatch j, so each batch shard keeps its own rows. Only stage 0 reads inputs:
        they sit in its slot of a stage-sharded buffer, so the per-tick read and its
        gradient stay on the device."""
        s, x_mbtd = self.pipe.stages, self.microbatches(x_btd)
        first_slot = (jnp.arange(s) == 0)[:, None, None, None, None]
        spec = self.slot_spec().spec
        return jax.lax.with_sharding_constraint(
            jnp.where(first_slot, x_mbtd[None], jnp.zeros_like(x_mbtd[None])),
            self.sharding(spec[0], None, *spec[1:]))

    def microbatches(self, a):
        """[B, ...] -> [M, B/M, ...]: row i*M + j goes to microbatch j (`inputs`)."""
        return a.reshape(a.shape[0] // self.pipe.microbatches, self.pipe.microbatches, *a.shape[1:]).swapaxes(0, 1)

    @property
    def copies(self) -> bool:
        """Whether each batch shard gets its own copy of the stage weights (not under ZeRO-2)."""
        return self.grads_pins is None

    def weights(self, stacked):
        """Block params [S, r*Lc, ...] as compute wants them, made once per step: copies
        [n, S, r, Lc, ...], one per batch shard, so weight gradients accumulate per shard
        over all ticks and are reduced across shards once, when autodiff transposes the
        copy (under FSDP this is the one all-gather, and transposed the one
        reduce-scatter); under ZeRO-2 shared [S, r, Lc, ...], gradients as `grads`."""
        s, r, n = self.pipe.stages, self.pipe.repeats, self.n_shards

        def per_shard(a, axes):
            a = a.reshape(s, r, a.shape[1] // r, *a.shape[2:])
            a = jnp.broadcast_to(a[None], (n, *a.shape))
            return jax.lax.with_sharding_constraint(a, self.weight_sharding(axes))

        def shared(a, axes):
            a = a.reshape(s, r, a.shape[1] // r, *a.shape[2:])
            stored = self.layout.spec(axes, "params")
            return grad_reduce.constrain_both_ways(a, self.sharding(stored[0], None, *stored[1:]),
                                                   self.weight_sharding(axes))
        return jax.tree.map(per_shard if self.copies else shared, stacked, self.blocks_axes)

    def weight_sharding(self, axes) -> NamedSharding:
        """Where one block param's compute weights (`weights`) live, and their gradient:
        copies [n, S, r, Lc, ...] split over the batch shards and compute's split of the
        rest; shared [S, r, Lc, ...] as the `grads` table says."""
        if self.copies:
            rest = self.inner.spec(axes[2:], "activations")
            return self.sharding(self.shard, "stage", None, None, *rest)
        grads = self.layout.spec(axes, "grads")
        return self.sharding(grads[0], None, *grads[1:])

    def keys(self, key, stacked):
        """[S, r, Lc] dropout keys, one per model layer laid out like the params, or None."""
        if key is None:
            return None
        s, r = self.pipe.stages, self.pipe.repeats
        num_layers = s * jax.tree.leaves(stacked)[0].shape[1]
        return to_stages(jax.random.split(key, num_layers), self.pipe).reshape(s, r, -1)

    def chunk_fn(self, make_layer, *, scan_layers: bool, documents=None) -> Callable:
        """chunk(w, k, m, x [mb, T, D]) -> y: one stage's chunk of Lc layers on microbatch m,
        with w its weights (copies [n, Lc, ...] or shared [Lc, ...]) and k [Lc] its keys;
        microbatch m's layers see its rows of the batch's `documents` (models/documents.py)."""
        n, shard = self.n_shards, self.shard
        micro_docs = jax.tree.map(self.microbatches, documents)
        pinned = None if self.grads_pins is None else grad_reduce.pinned_in_backward(self.grads_pins)

        def shard_fn(w, k, x, shard_index, docs):  # one stage, one batch shard: x [mb/n, T, D]
            layer = make_layer(Constrain(self.inner, self.mesh, docs))
            run_one = layer if pinned is None else (lambda x, params, k: layer(x, pinned(params), k))
            if k is not None:
                k = jax.vmap(jax.random.fold_in, (0, None))(k, shard_index)
            return run_stack(run_one, w, x, k, scan=scan_layers)

        def chunk(w, k, m, x):
            if k is not None:
                k = jax.vmap(jax.random.fold_in, (0, None))(k, m)
            docs = jax.tree.map(lambda a: self.rows(jax.lax.dynamic_index_in_dim(a, m, 0, keepdims=False)),
                                micro_docs)
            y = jax.vmap(shard_fn, (0 if self.copies else None, None, 0, 0, 0), spmd_axis_name=shard)(
                w, k, self.rows(x), jnp.arange(n), docs)
            return self.unrows(y)
        return chunk

    def rows(self, x):
        """[mb, ...] -> [n, mb/n, ...]: a microbatch's rows per batch shard."""
        return x.reshape(self.n_shards, x.shape[0] // self.n_shards, *x.shape[1:])

    def unrows(self, x):
        return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])

    def layer_fn(self, make_layer, documents=None) -> Callable:
        """-> at(m) -> layer(w, k, x [n, mb/n, T, D]) -> like x: one layer of a stage's chunk
        on microbatch m, every batch shard at once (split_backward.LayerSplit's layer), w one
        layer's weights (copies [n, ...] or shared), k its key folded with m, or None. The
        same keys, documents and ZeRO-2 pins as chunk_fn's."""
        n, shard = self.n_shards, self.shard
        micro_docs = jax.tree.map(self.microbatches, documents)
        pinned = None if self.grads_pins is None else grad_reduce.pinned_in_backward(self.grads_pins)

        def at(m):
            docs = jax.tree.map(lambda a: self.rows(jax.lax.dynamic_index_in_dim(a, m, 0, keepdims=False)),
                                micro_docs)

            def shard_fn(w, k, shard_index, docs, x):
                layer = make_layer(Constrain(self.inner, self.mesh, docs))
                return layer(x, w if pinned is None else pinned(w),
                             None if k is None else jax.random.fold_in(k, shard_index))

            def layer(w, k, x):
                return jax.vmap(shard_fn, (0 if self.copies else None, None, 0, 0, 0), spmd_axis_name=shard)(
                    w, k, jnp.arange(n), docs, x)
            return layer
        return at

    @property
    def layer_axis(self) -> int:
        """The layer dim of a chunk's weights: behind the copies' shard dim, or first."""
        return 1 if self.copies else 0

    def select(self, w, i):
        """Stage weights (copies [n, r, Lc, ...] or shared [r, Lc, ...]) -> chunk i's."""
        return jax.tree.map(lambda a: a[:, i] if self.copies else a[i], w)

    @property
    def w_axis(self) -> int:
        """The stage dim of `weights`: behind the copies' shard dim, or first."""
        return 1 if self.copies else 0


def stage_plan(pipe: Pipeline, layout: Layout, mesh: Mesh, blocks_axes, grads_pins=None) -> StagePlan:
    n_shards, batch_axes = layout.without("stage").shards("batch", mesh.shape)
    return StagePlan(pipe, layout, mesh, blocks_axes, grads_pins, n_shards, batch_axes or None,
                     layout.without("stage", *batch_axes))


def make_runner(pipe: Pipeline, layout: Layout, mesh: Mesh, blocks_axes, *,
                scan_layers: bool = True, grads_pins=None) -> Callable:
    """run_layers(make_layer, stacked, x [B, T, D], key, documents) -> [B, T, D] for a model's forward
    pass under the gpipe or circular schedule (and the forward-only pass of 1f1b and
    interleaved: eval, logits); backward by autodiff through the ticks.

    `stacked` holds the block params [S, r*Lc, ...]; `make_layer(constrain)` returns
    layer(x [b, T, D], one layer's params, key) -> x. See StagePlan for the two vmaps
    and the weight copies.

    With `grads_pins` (grad_reduce.grads_pins: ZeRO-2) there is no copy: the batch
    shards share their stage's weights, and grad_reduce.pinned_in_backward on each
    layer's params inside the layer scan reduce-scatters that layer's gradient, summed
    over the shards, into the `grads` spec as the backward pass makes it: once per layer
    per tick, so the weight gradients accumulate over the ticks split, never whole, for
    r*M + S - 1 times the reduce-scatters of one reduction per step.
    """
    s, r, n_micro = pipe.stages, pipe.repeats, pipe.microbatches
    plan = stage_plan(pipe, layout, mesh, blocks_axes, grads_pins)
    buf_spec = plan.slot_spec()

    def run_layers(make_layer, stacked, x_btd, key, documents=None):
        chunk = plan.chunk_fn(make_layer, scan_layers=scan_layers, documents=documents)
        b, t, d = x_btd.shape
        mb = b // n_micro
        inputs = plan.inputs(x_btd)
        weights, keys = plan.weights(stacked), plan.keys(key, stacked)

        def stage_fn(w, k, i, m, x):  # one stage: x [mb, T, D]
            return chunk(plan.select(w, i), None if k is None else k[i], m, x)

        def tick(buf, t_now):
            _, i, m = schedule(pipe, t_now)
            m0 = (t_now // (r * s)) * s + t_now % s  # stage 0's microbatch, as a scalar
            fresh = jax.lax.dynamic_index_in_dim(inputs, jnp.minimum(m0, n_micro - 1), 1, keepdims=False)
            first = ((jnp.arange(s) == 0) & (i == 0))[:, None, None, None]
            buf = jnp.where(first, fresh, jnp.roll(buf, 1, axis=0))
            buf = jax.vmap(stage_fn, (plan.w_axis, 0, 0, 0, 0), spmd_axis_name="stage")(
                weights, keys, i, m, buf)
            buf = jax.lax.with_sharding_constraint(buf, buf_spec)
            return buf, buf

        buf0 = jax.lax.with_sharding_constraint(jnp.zeros((s, mb, t, d), x_btd.dtype), buf_spec)
        _, ys = jax.lax.scan(tick, buf0, jnp.arange(pipe.ticks),
                             unroll=pipe.ticks if pipe.unroll else 1)
        # ys [ticks, S, mb, T, D] stays where each stage wrote it; only the last stage's
        # finished microbatches leave it.
        ys = jax.lax.with_sharding_constraint(ys, plan.sharding(None, *buf_spec.spec))
        out = ys[output_ticks(pipe), s - 1]  # [M, mb, T, D]
        return out.swapaxes(0, 1).reshape(b, t, d)

    return run_layers
