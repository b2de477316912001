"""How a pipeline's stages run on the mesh: StagePlan (the vmap over stages and the one
over a microbatch's batch shards, the weight copies, a stage's chunk of layers and its
layers one at a time), shared by the forward-only runner of gpipe and circular here and
the tick loops of 1f1b, interleaved and zb (schedule_1f1b.py, schedule_zb.py). The
schedule itself is meshtrain/parallel/pipeline/scan.py's."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from meshtrain.models.stack import run_stack
from meshtrain.parallel import grad_reduce
from meshtrain.parallel.hook import Constrain
from meshtrain.parallel.layouts.rules import Layout
from meshtrain.parallel.pipeline.scan import Pipeline, output_ticks, schedule, to_stages


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
        docs_at, shard_layer = self._shard_parts(make_layer, documents)

        def shard_fn(w, k, shard_index, docs, x):  # one stage, one batch shard: x [mb/n, T, D]
            if k is not None:
                k = jax.vmap(jax.random.fold_in, (0, None))(k, shard_index)
            return run_stack(shard_layer(docs), w, x, k, scan=scan_layers)

        def chunk(w, k, m, x):
            if k is not None:
                k = jax.vmap(jax.random.fold_in, (0, None))(k, m)
            return self.unrows(self._over_shards(shard_fn, w, k, docs_at(m), self.rows(x)))
        return chunk

    def layer_fn(self, make_layer, documents=None) -> Callable:
        """-> at(m) -> layer(w, k, x [n, mb/n, T, D]) -> like x: one layer of a stage's chunk
        on microbatch m, every batch shard at once (split_backward.LayerSplit's layer), w one
        layer's weights (copies [n, ...] or shared), k its key folded with m, or None. The
        same keys, documents and ZeRO-2 pins as chunk_fn's."""
        docs_at, shard_layer = self._shard_parts(make_layer, documents)

        def shard_fn(w, k, shard_index, docs, x):
            return shard_layer(docs)(x, w, None if k is None else jax.random.fold_in(k, shard_index))

        def at(m):
            docs = docs_at(m)
            return lambda w, k, x: self._over_shards(shard_fn, w, k, docs, x)
        return at

    def _shard_parts(self, make_layer, documents):
        """-> (docs_at(m): microbatch m's rows of `documents` per batch shard, [n, mb/n, ...];
        shard_layer(docs): one shard's layer(x, params, key), its weight gradients pinned
        under ZeRO-2 (grads_pins))."""
        micro_docs = jax.tree.map(self.microbatches, documents)
        pinned = None if self.grads_pins is None else grad_reduce.pinned_in_backward(self.grads_pins)

        def docs_at(m):
            return jax.tree.map(lambda a: self.rows(jax.lax.dynamic_index_in_dim(a, m, 0, keepdims=False)),
                                micro_docs)

        def shard_layer(docs):
            layer = make_layer(Constrain(self.inner, self.mesh, docs))
            return layer if pinned is None else (lambda x, params, k: layer(x, pinned(params), k))
        return docs_at, shard_layer

    def _over_shards(self, shard_fn, w, k, docs, x):
        """shard_fn(w, k, shard index, docs, x) on every batch shard at once: w copies [n, ...]
        split over them or shared, x and docs [n, ...], k the same for all."""
        return jax.vmap(shard_fn, (0 if self.copies else None, None, 0, 0, 0), spmd_axis_name=self.shard)(
            w, k, jnp.arange(self.n_shards), docs, x)

    def rows(self, x):
        """[mb, ...] -> [n, mb/n, ...]: a microbatch's rows per batch shard."""
        return x.reshape(self.n_shards, x.shape[0] // self.n_shards, *x.shape[1:])

    def unrows(self, x):
        return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])

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
