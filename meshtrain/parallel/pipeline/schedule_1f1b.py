"""1F1B and interleaved 1F1B in one SPMD program: the loss and its gradients from one tick
loop in which every stage runs a forward slot and a backward slot per tick.

Under gpipe and circular (meshtrain/parallel/pipeline/scan.py) the backward pass is autodiff of the
forward ticks, so each stage keeps every microbatch's activations until all forwards
are done. Here the backward is written per stage: the loss head runs on the last
stage's output inside the loop, so microbatch m's backward starts on the tick its
forward ends, and a stage keeps an item only between its two slots
(meshtrain/parallel/pipeline/ticks.py gives the schedule and counts them):

    x = embed(tokens)  -> inputs [S, M, mb, T, D] in stage 0's slot      (vjp kept)
    w = stage weights, copies [n, S, v, Lc, ...] made once per step      (vjp kept)
    for t in ticks (warm-up: forward slots; steady: both; cool-down: backward):
        forward slot, every stage s at once (vmap over `stage`):
            x_s = inputs[m] on stage 0 in repeat 0, else what stage s-1 sent last tick
            stash[s, i, m mod K] = x_s;   y_s = chunk(w[s, i], x_s)
        head, on the last stage's y when it finished repeat v-1 of microbatch m:
            loss_m, dy, d_head = value_and_grad(sum of the loss over m's targets)
        backward slot, every stage at once:
            g_s = dy on the last stage in repeat v-1, else what stage s+1 sent last tick
            d w[s, i], dx_s = vjp of chunk(w[s, i], stash[s, i, m mod K]) at g_s
            stage 0 in repeat 0 keeps dx_s as d inputs[m]
    d params = vjp of embed and the weight copies at (d inputs, d w, d head)

`pipeline.stash` picks what the backward slot starts from: "inputs" (the default) keeps
each item's chunk input [mb, T, D] and recomputes the chunk's forward in the backward
slot, one item's residuals alive at a time; "residuals" keeps each item's residuals
from the forward slot and computes no forward twice. docs/pipeline.md measures both.

The loss is the mean over all B x T targets, so each microbatch's summed loss and its
gradients are scaled by 1/(B T) where they are made. The weight gradients build up
per batch shard (the copies) and per stage over all ticks, in float32, and are reduced
over the batch shards once, by the copies' vjp; the head's gradients likewise.

The head runs on every stage's devices, with the vocabulary split over `stage` (and
`tensor` where the layout splits it) when the padded vocabulary divides: the last
stage's output goes to every stage, each computes 1/S of the logits, and their
gradients for the output meet in one reduction. Without the split, every stage would
compute the whole head and the tick would last as long.

The loss function this module builds has a custom VJP: its primal (eval, or any call
without a gradient) runs the forward-only ticks of meshtrain/parallel/pipeline/scan.py, whose storage
order and keys are the same, and its forward under autodiff runs the tick loop and
keeps the gradients for the backward to scale by the loss's cotangent.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from meshtrain.errors import UserError
from meshtrain.models import family, stack
from meshtrain.models.stack import layer_maker
from meshtrain.parallel.hook import Constrain
from meshtrain.parallel.layouts import Layout
from meshtrain.parallel.pipeline.stages import StagePlan
from meshtrain.parallel.pipeline.split_backward import LayerSplit
from meshtrain.parallel.pipeline.ticks import backward_items, forward_items, segments, stash_slots


def head_layout(inner: Layout, mesh_shape, padded_vocab: int) -> Layout:
    """`inner` (the layout a stage sees) with `stage` added to the activations' vocab rule,
    first, when the padded vocabulary divides over it: the head's logits split over the
    stages. Else `inner`, and every stage computes the whole head."""
    axes = (*dict(inner.activations).get("vocab", ()), "stage")
    if padded_vocab % math.prod(mesh_shape[a] for a in axes):
        return inner
    acts = (("vocab", axes), *((n, a) for n, a in inner.activations if n != "vocab"))
    return dataclasses.replace(inner, name=f"{inner.name}, vocab over stage", activations=acts)


class Carry(NamedTuple):
    """What one tick hands the next (S stages, v repeats, K stash slots, n batch shards)."""

    fwd: jax.Array       # [S, mb, T, D]: what each stage's forward slot sends on
    bwd: jax.Array       # [S, mb, T, D]: what each stage's backward slot sends back
    loss: jax.Array      # []: the loss so far, each microbatch's scaled by 1/(B T)
    stash: list          # per stashed leaf [S, v, K, ...]: items between their two slots
    d_w: Any             # like the stage weights, float32: their gradients so far
    d_head: Any          # like the head's n copies, float32
    d_inputs: jax.Array  # like the inputs: stage 0's dx of each microbatch
    w_stash: list = []   # zb: per leaf [S, K_w, ...], W's inputs between an item's B and W


def stash_zeros(plan: StagePlan, shape, dtype) -> jax.Array:
    """Zeros for a stash [S, ...], split over `stage`; the item's own dims as XLA places
    them (a residual's batch shards where the layer put them)."""
    spec = ("stage", *[P.UNCONSTRAINED] * (len(shape) - 1))
    return jax.lax.with_sharding_constraint(jnp.zeros(shape, dtype), plan.sharding(*spec))


class Schedule:
    """(params, tokens [B, T+1], key) -> (mean loss, grads like params) by the tick loop:
    what one configuration fixes (the model, the stage plan, the head's layout and specs)."""

    def __init__(self, model, plan: StagePlan, *, constrain: Constrain, cast: Callable, head_loss: Callable,
                 documents: Callable | None = None, loop: type | None = None):
        pipe = plan.pipe
        if not family.implements(model.family.module, family.PipelineEnds):
            raise UserError(
                f"pipeline.schedule={pipe.schedule}: model family {model.family.name!r} does not split its "
                f"forward pass into embed_tokens and head (docs/models.md, the model seam), which the 1F1B "
                f"tick loop runs apart. Use pipeline.schedule={'circular' if pipe.repeats > 1 else 'gpipe'}, "
                f"or give the family those two methods.")
        self.model, self.plan, self.pipe, self.mesh = model, plan, pipe, plan.mesh
        self.loop = loop or TickLoop  # or a subclass: schedule_zb.ZeroBubbleLoop
        # head_loss(bound model, h [B, T, D], w, targets [B, T], weights, constrain, layout, mesh) -> mean:
        # the step's loss after the last block (step/loss.py), which the schedule runs on every stage.
        self.constrain, self.cast, self.head_loss = constrain, cast, head_loss
        # documents(tokens [B, T+1], constrain) -> (constrain, weights [B, T] or None): the
        # task's (tasks/language.py); None packs windows as one stream.
        self.documents = documents or (lambda tokens, constrain: (constrain, None))
        self.k_slots = stash_slots(pipe)
        self.head_layout = head_layout(plan.inner, plan.mesh.shape, model.cfg.padded_vocab_size)
        self.head_constrain = Constrain(self.head_layout, plan.mesh)
        self.slot = plan.slot_spec()                                   # [S, mb, T, D] per tick
        self.head_in = plan.sharding(plan.shard, *self.slot.spec[2:])  # the last stage's y, on every stage
        self.stage_vmap = dict(spmd_axis_name="stage")

    def copies_spec(self, axes):
        """One copy per batch shard of a head param, as compute wants it."""
        return self.plan.sharding(self.plan.shard, *self.head_layout.spec(axes, "activations"))

    def __call__(self, params, tokens_bt1, key):
        return self.loop(self, params, tokens_bt1, key).run()


class TickLoop:
    """One traced call of the schedule: the step's inputs, weights and head, and the slots
    a tick runs (the module docstring's loop)."""

    def __init__(self, sched: Schedule, params, tokens_bt1, key):
        self.sched, model, plan = sched, sched.model, sched.plan
        inputs_bt, targets_bt = tokens_bt1[:, :-1], tokens_bt1[:, 1:]
        constrain, weights_bt = sched.documents(tokens_bt1, sched.constrain)
        self.b, self.t = inputs_bt.shape
        self.mb = self.b // sched.pipe.microbatches
        k_embed, k_layers = (None, None) if key is None else tuple(jax.random.split(key))
        stacked = model.stacked
        head_axes = {k: a for k, a in model.axes.items() if k != stacked}

        def prepare(params):  # -> (inputs, stage weights, head copies), under one vjp
            cast_params = sched.cast(params)
            module = model.bind(cast_params)
            inputs = plan.inputs(module.embed_tokens(inputs_bt, constrain, k_embed))
            head = {k: p for k, p in cast_params.items() if k != stacked}
            head = jax.tree.map(lambda p, axes: jax.lax.with_sharding_constraint(
                jnp.broadcast_to(p[None], (plan.n_shards, *p.shape)), sched.copies_spec(axes)), head, head_axes)
            return inputs, plan.weights(cast_params[stacked]), head

        (self.inputs, self.weights, self.head), self.prepare_vjp = jax.vjp(prepare, params)
        self.keys = plan.keys(k_layers, params[stacked])
        make_layer, _ = layer_maker(getattr(model.bind(params), stacked), model.cfg.remat)
        self.chunk = plan.chunk_fn(make_layer, scan_layers=model.cfg.scan_layers, documents=constrain.documents)
        self.layer_at = plan.layer_fn(make_layer, documents=constrain.documents)
        # embed_tokens put the positions in the layout's storage order (context parallelism,
        # parallel/sequence.py); the targets and their weights follow them.
        micro = lambda a: None if a is None else plan.microbatches(stack.stored(a, sched.constrain))  # noqa: E731
        self.targets, self.target_weights = micro(targets_bt), micro(weights_bt)  # [M, mb, T]
        self.blocks = params[stacked]
        self.head_grad = jax.vmap(jax.value_and_grad(self.shard_head, argnums=(0, 1)), spmd_axis_name=plan.shard)

    # -- one stage, one item -----------------------------------------------------------

    def shard_head(self, head_params, x_btd, y_bt, w_bt=None):
        """One batch shard's head -> its loss summed over its targets (weighted by w)."""
        sched = self.sched
        bound = sched.model.bind({**head_params, sched.model.stacked: self.blocks})
        h_btd, w = bound.head(x_btd, sched.head_constrain)
        mean = sched.head_loss(bound, h_btd, w, y_bt, w_bt, sched.head_constrain, sched.head_layout, sched.mesh)
        return mean * y_bt.size

    def stage_keys(self, i):
        """Per stage [S]: chunk i's keys (the chunk folds in the microbatch)."""
        return None if self.keys is None else jax.vmap(lambda k, i: k[i])(self.keys, i)

    def layers(self, w, k, m, x_rows) -> tuple[LayerSplit, Any]:
        """Chunk weights w, keys k [Lc], microbatch m and x [n, mb/n, T, D] -> the chunk's
        layers one at a time (split_backward.LayerSplit), and their keys folded with m."""
        k = None if k is None else jax.vmap(jax.random.fold_in, (0, None))(k, m)
        return LayerSplit(self.layer_at(m), w, k, x_rows, axis=self.sched.plan.layer_axis), k

    def fwd_one(self, w, k, i, m, x):
        """One stage's forward slot -> (y, the leaves to stash): the chunk's input, or each
        layer's residuals but its weights."""
        plan = self.sched.plan
        wi = plan.select(w, i)
        if self.sched.pipe.stash == "inputs":
            return self.chunk(wi, k, m, x), [x]
        layers, k = self.layers(wi, k, m, plan.rows(x))
        y, res = layers.forward(wi, k, plan.rows(x))
        return plan.unrows(y), res

    def bwd_one(self, w, k, i, m, items, g):
        """One stage's backward slot -> (d chunk weights, dx)."""
        plan = self.sched.plan
        wi = plan.select(w, i)
        if self.sched.pipe.stash == "inputs":
            _, pull = jax.vjp(lambda wi, x: self.chunk(wi, k, m, x), wi, items[0])
            return pull(g)
        dx, dw = self.layers(wi, k, m, plan.rows(g))[0].backward(wi, items, plan.rows(g))
        return dw, plan.unrows(dx)

    # -- the slots of a tick, every stage at once ----------------------------------------

    def forward_slot(self, carry: Carry, t_now) -> tuple[Carry, tuple]:
        sched, s = self.sched, self.sched.pipe.stages
        fv, fi, fm = forward_items(sched.pipe, t_now, jnp)
        fresh = jax.lax.dynamic_index_in_dim(self.inputs, fm[0], 1, keepdims=False)  # stage 0's
        first = ((jnp.arange(s) == 0) & (fi == 0))[:, None, None, None]
        x = jax.lax.with_sharding_constraint(jnp.where(first, fresh, jnp.roll(carry.fwd, 1, axis=0)), sched.slot)
        y, items = jax.vmap(self.fwd_one, (sched.plan.w_axis, 0, 0, 0, 0), **sched.stage_vmap)(
            self.weights, self.stage_keys(fi), fi, fm, x)
        y = jax.lax.with_sharding_constraint(y, sched.slot)

        def store(stash_s, valid, i, m, item):  # one stage keeps an item in slot (i, m mod K)
            old = stash_s[i, m % sched.k_slots]
            return stash_s.at[i, m % sched.k_slots].set(jnp.where(valid, item, old))
        stash = [jax.vmap(store, **sched.stage_vmap)(st, fv, fi, fm, item) for st, item in zip(carry.stash, items)]
        return carry._replace(fwd=y, stash=stash), (fv, fi, fm, y)

    def head_slot(self, carry: Carry, fwd_items) -> tuple[Carry, jax.Array]:
        """The loss head on the last stage's y where it finished repeat v-1: -> dy."""
        sched, (fv, fi, fm, y) = self.sched, fwd_items
        s, v, n, mb, t = sched.pipe.stages, sched.pipe.repeats, sched.plan.n_shards, self.mb, self.t
        valid = fv[s - 1] & (fi[s - 1] == v - 1)
        y_last = jax.lax.with_sharding_constraint(y[s - 1], sched.head_in)
        tgt, wts = (None if a is None else jax.lax.dynamic_index_in_dim(a, fm[s - 1], 0, keepdims=False)
                    .reshape(n, mb // n, t) for a in (self.targets, self.target_weights))
        loss_n, (d_head, dy) = self.head_grad(self.head, y_last.reshape(n, mb // n, t, -1), tgt, wts)
        scale = jnp.where(valid, 1.0 / (self.b * t), 0.0)
        acc = jax.tree.map(lambda a, d: a + scale * d.astype(a.dtype), carry.d_head, d_head)
        dy = (dy.reshape(mb, t, -1) * scale).astype(y.dtype)
        return carry._replace(d_head=acc, loss=carry.loss + scale * loss_n.sum()), dy

    def backward_slot(self, carry: Carry, t_now, dy) -> Carry:
        sched, s, v = self.sched, self.sched.pipe.stages, self.sched.pipe.repeats
        plan, vmap = sched.plan, sched.stage_vmap
        bv, bi, bm = backward_items(sched.pipe, t_now, jnp)
        g = jnp.roll(carry.bwd, -1, axis=0)
        if dy is not None:
            last = ((jnp.arange(s) == s - 1) & (bi == v - 1))[:, None, None, None]
            g = jnp.where(last, dy[None], g)
        g = jax.lax.with_sharding_constraint(jnp.where(bv[:, None, None, None], g, 0), sched.slot)
        items = [jax.vmap(lambda st, i, m: st[i, m % sched.k_slots], **vmap)(st, bi, bm) for st in carry.stash]
        weight_part, dx = jax.vmap(self.bwd_one, (plan.w_axis, 0, 0, 0, 0, 0), **vmap)(
            self.weights, self.stage_keys(bi), bi, bm, items, g)
        carry = self.keep_weight_part(carry, weight_part, t_now, bv, bi)
        dx = jax.lax.with_sharding_constraint(dx, sched.slot)

        def keep_dx(d_in_s, is_first, m, dx_s):  # stage 0, repeat 0: d inputs[m]
            return d_in_s.at[m].set(jnp.where(is_first, dx_s, d_in_s[m]))
        is_first = (jnp.arange(s) == 0) & (bi == 0) & bv
        d_inputs = jax.vmap(keep_dx, **vmap)(carry.d_inputs, is_first, bm, dx)
        return carry._replace(bwd=dx, d_inputs=d_inputs)

    def keep_weight_part(self, carry: Carry, dw, t_now, valid, i) -> Carry:
        """What the backward slot made beside dx: 1F1B's weight gradients, added up."""
        return self.add_dw(carry, dw, i)

    def add_dw(self, carry: Carry, dw, i) -> Carry:
        """d_w [.., S, v, Lc, ...] += dw [.., S, Lc, ...] at each stage's chunk i; dw like
        the weights, or their flat list with None where there is nothing to add."""
        plan, vmap = self.sched.plan, self.sched.stage_vmap

        def add(acc, d):
            def one(acc_s, d_s, i):
                return (acc_s.at[:, i] if plan.copies else acc_s.at[i]).add(d_s.astype(acc_s.dtype))
            return acc if d is None else jax.vmap(one, (plan.w_axis, 0, 0), plan.w_axis, **vmap)(acc, d, i)
        acc, tree = jax.tree.flatten(carry.d_w)
        parts = dw if isinstance(dw, list) else tree.flatten_up_to(dw)
        return carry._replace(d_w=tree.unflatten([add(a, d) for a, d in zip(acc, parts)]))

    # -- the loop -------------------------------------------------------------------------

    def tick(self, slots: str):
        """-> one tick's body running `slots` (ticks.segments): the forward slot, the loss
        head where the last stage's forward meets its backward, the backward slot."""
        def body(carry: Carry, t_now):
            dy = None
            if "f" in slots:
                carry, fwd_items = self.forward_slot(carry, t_now)
                if "b" in slots:
                    carry, dy = self.head_slot(carry, fwd_items)
            if "b" in slots:
                carry = self.backward_slot(carry, t_now, dy)
            return carry, None
        return body

    def start(self) -> Carry:
        """Zeros, with the stash shaped from a trace of the forward slot."""
        sched, s, v = self.sched, self.sched.pipe.stages, self.sched.pipe.repeats
        plan, k_slots, dtype = sched.plan, sched.k_slots, self.inputs.dtype
        zeros_slot = jax.lax.with_sharding_constraint(jnp.zeros((s, self.mb, self.t, self.inputs.shape[-1]), dtype),
                                                      sched.slot)
        first = jnp.zeros(s, int)
        _, items = jax.eval_shape(lambda: jax.vmap(self.fwd_one, (plan.w_axis, 0, 0, 0, 0), **sched.stage_vmap)(
            self.weights, self.stage_keys(first), first, first, zeros_slot))
        if sched.pipe.stash == "inputs":
            stash_spec = plan.sharding(sched.slot.spec[0], None, None, *sched.slot.spec[1:])
            stash = [jax.lax.with_sharding_constraint(jnp.zeros((s, v, k_slots, *items[0].shape[1:]), dtype),
                                                      stash_spec)]
        else:  # each layer's residuals [S, v, K, Lc, ...]
            stash = [stash_zeros(plan, (s, v, k_slots, *a.shape[1:]), a.dtype) for a in items]
        f32 = lambda a: jnp.zeros(a.shape, jnp.promote_types(a.dtype, jnp.float32))  # noqa: E731
        d_w = jax.tree.map(lambda a, axes: jax.lax.with_sharding_constraint(f32(a), plan.weight_sharding(axes)),
                           self.weights, plan.blocks_axes)
        return Carry(fwd=zeros_slot, bwd=zeros_slot, loss=jnp.zeros((), jnp.float32), stash=stash, d_w=d_w,
                     d_head=jax.tree.map(f32, self.head), d_inputs=jnp.zeros_like(self.inputs))

    def run(self):
        """-> (mean loss, grads like params): a loop per run of ticks with the same slots
        (warm-up, steady and cool-down under 1f1b), then the vjp of the embedding and the
        weight copies at what the slots gathered."""
        carry = self.start()
        for first, end, slots in segments(self.sched.pipe):
            carry, _ = jax.lax.scan(self.tick(slots), carry, jnp.arange(first, end),
                                    unroll=end - first if self.sched.pipe.unroll else 1)
        cotangents = (carry.d_inputs,
                      jax.tree.map(lambda d, w: d.astype(w.dtype), carry.d_w, self.weights),
                      jax.tree.map(lambda d, h: d.astype(h.dtype), carry.d_head, self.head))
        (grads,) = self.prepare_vjp(cotangents)
        return carry.loss, grads


def make_loss_fn(model, plan: StagePlan, forward_loss: Callable, *, constrain: Constrain,
                 cast: Callable, head_loss: Callable, documents: Callable | None = None,
                 loop: type | None = None) -> Callable:
    """loss_fn(params, tokens [B, T+1], key) -> mean loss: `forward_loss` (the forward-only
    ticks) when no gradient is taken, the tick loop's loss and gradients under autodiff."""
    loss_and_grads = Schedule(model, plan, constrain=constrain, cast=cast, head_loss=head_loss,
                              documents=documents, loop=loop)

    @jax.custom_vjp
    def loss_fn(params, tokens, key):
        return forward_loss(params, tokens, key)

    def fwd(params, tokens, key):
        return loss_and_grads(params, tokens, key)

    def bwd(grads, g):
        return jax.tree.map(lambda d: (g * d).astype(d.dtype), grads), None, None

    loss_fn.defvjp(fwd, bwd)
    return loss_fn
