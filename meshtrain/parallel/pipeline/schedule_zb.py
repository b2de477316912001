"""ZB-H1 in one SPMD program: 1F1B's tick loop with each backward slot split in two (Qi et
al. 2023, arXiv 2401.10241). The backward slot runs B, the input gradient that the
previous stage waits for, and keeps what W needs; a weight slot runs W, the weight
gradients, in the last v M ticks, where 1F1B's cool-down leaves the stages idle
(meshtrain/parallel/pipeline/ticks.py has the schedule and its idle share):

    backward slot, every stage s at once:
        dx_s, kept = B of chunk(w[s, i], stash[s, i, m mod K]) at g_s
        w_stash[s, u mod K_w] = kept            # u: the item's place in the backward order
    weight slot, every stage at once, on item u (the one stage 0 ran B of this tick):
        d w[s, i] += W(w_stash[s, u mod K_w])

`pipeline.split` picks how a chunk's backward splits. "jaxpr" (the default) traces each
layer's pullback and cuts it (split_backward.LayerSplit): B runs each equation the input
gradient needs, W the rest, reading B's values, so no matmul runs twice; the forward slot
keeps each layer's residuals (stash=residuals) or B runs the chunk forward again from its
input (stash=inputs). "two_vjps" takes one pullback for dx and another for the weights'
gradients, which runs the cotangent chain again: W keeps the chunk's input and g.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from meshtrain.parallel.pipeline.schedule_1f1b import Carry, TickLoop
from meshtrain.parallel.pipeline.split_backward import LayerSplit
from meshtrain.parallel.pipeline.ticks import weight_items, weight_stash_slots, weight_u, backward_u


def _split(layer, w, k, x) -> LayerSplit:
    """The stage layer (x, params, key) -> x as split_backward's layer(w, k, x)."""
    return LayerSplit(lambda w, k, x: layer(x, w, k), w, k, x)


def _forward(layer, w, k, x):
    return _split(layer, w, k, x).forward(w, k, x)


def _input_grads(layer, w, k, res, g):
    return _split(layer, w, k, g).input_grads(w, res, g)


def _recompute_and_input_grads(layer, w, k, x, g):
    split = _split(layer, w, k, x)
    return split.input_grads(w, split.forward(w, k, x)[1], g)


class ZeroBubbleLoop(TickLoop):
    """The tick loop of schedule zb: B in the backward slot, W in a weight slot."""

    def __init__(self, sched, params, tokens_bt1, key):
        super().__init__(sched, params, tokens_bt1, key)
        self.k_weight = weight_stash_slots(sched.pipe)
        self.by_layer = sched.pipe.split == "jaxpr"
        # Each shard differentiates its own layers here: the sum over shards, and its split
        # under ZeRO-2, come after W (w_one), where the accumulator's sharding asks for it.
        self.per_shard = sched.plan.per_shard(self.make_layer, self.documents, pin=False)
        plan = sched.plan
        self.x_shard = jax.ShapeDtypeStruct((self.mb // plan.n_shards, self.t, self.inputs.shape[-1]),
                                            self.inputs.dtype)

    # -- one stage, one item -----------------------------------------------------------

    def fwd_one(self, w, k, i, m, x):
        """-> (y, the leaves to stash): the chunk's input, or its layers' residuals."""
        if self.sched.pipe.stash == "inputs":
            return super().fwd_one(w, k, i, m, x)
        if not self.by_layer:  # the chunk's pullback, and its input for W's own pullback
            y, leaves = super().fwd_one(w, k, i, m, x)
            return y, [*leaves, x]
        plan = self.sched.plan
        y, res = self.per_shard(_forward, plan.select(w, i), k, m, plan.rows(x))
        return plan.unrows(y), res

    def bwd_one(self, w, k, i, m, items, g):
        """B: -> (what W needs, dx)."""
        plan, stash = self.sched.plan, self.sched.pipe.stash
        wi = plan.select(w, i)
        if self.by_layer:
            if stash == "inputs":
                dx, kept = self.per_shard(_recompute_and_input_grads, wi, k, m, plan.rows(items[0]), plan.rows(g))
            else:
                dx, kept = self.per_shard(_input_grads, wi, k, m, items, plan.rows(g))
            return kept, plan.unrows(dx)
        x = items[0] if stash == "inputs" else items[-1]
        if stash == "inputs":
            (dx,) = jax.vjp(lambda x: self.chunk(wi, k, m, x), x)[1](g)
        else:
            dx = super().bwd_one(w, k, i, m, items[:-1], g)[1]
        return [x, g], dx

    def w_one(self, w, k, i, m, kept):
        """W: -> d chunk weights, like the chunk's."""
        plan = self.sched.plan
        wi = plan.select(w, i)
        if not self.by_layer:
            x, g = kept
            return jax.vjp(lambda wi: self.chunk(wi, k, m, x), wi)[1](g)[0]
        x = self.x_shard
        dw = self.per_shard(lambda layer, w, k, kept: _split(layer, w, k, x).weight_grads(w, kept), wi, k, m, kept)
        # Shared weights (ZeRO-2) came into the shards unbatched: their gradient sums the shards'.
        return dw if plan.copies else jax.tree.map(lambda d: d.sum(0), dw)

    # -- the slots ------------------------------------------------------------------------

    def keep_weight_part(self, carry: Carry, kept, t_now, valid, i) -> Carry:
        """B's values for W, kept in slot u mod K_w of each stage's weight stash."""
        slot = backward_u(self.sched.pipe, t_now, jnp) % self.k_weight

        def store(stash_s, valid, slot, item):
            return stash_s.at[slot].set(jnp.where(valid, item, stash_s[slot]))
        w_stash = [jax.vmap(store, **self.sched.stage_vmap)(st, valid, slot, item)
                   for st, item in zip(carry.w_stash, kept)]
        return carry._replace(w_stash=w_stash)

    def weight_slot(self, carry: Carry, t_now) -> Carry:
        sched, vmap = self.sched, self.sched.stage_vmap
        _, wi, wm = weight_items(sched.pipe, t_now, jnp)  # valid on every tick of a "w" segment
        slot = weight_u(sched.pipe, t_now, jnp) % self.k_weight
        kept = [jax.vmap(lambda st, j: st[j], **vmap)(st, slot) for st in carry.w_stash]
        dw = jax.vmap(self.w_one, (sched.plan.w_axis, 0, 0, 0, 0), **vmap)(
            self.weights, self.stage_keys(wi), wi, wm, kept)
        return self.add_dw(carry, dw, wi)

    def tick(self, slots: str):
        body = super().tick(slots)
        if "w" not in slots:
            return body

        def with_weights(carry, t_now):
            carry, _ = body(carry, t_now)
            return self.weight_slot(carry, t_now), None
        return with_weights

    def start(self) -> Carry:
        """1F1B's zeros, the weight stash shaped from a trace of the backward slot."""
        carry = super().start()
        sched, plan, s = self.sched, self.sched.plan, self.sched.pipe.stages
        first = jnp.zeros(s, int)
        if self.by_layer and sched.pipe.stash == "residuals":  # layers' residuals [S, v, K, n, Lc, ...]
            _, items = jax.eval_shape(lambda: jax.vmap(self.fwd_one, (plan.w_axis, 0, 0, 0, 0), **sched.stage_vmap)(
                self.weights, self.stage_keys(first), first, first, carry.fwd))
            carry = carry._replace(stash=[self._zeros((s, sched.pipe.repeats, sched.k_slots, *a.shape[1:]), a.dtype, 3)
                                          for a in items])
        items = [a[:, 0, 0] for a in carry.stash]
        kept, _ = jax.eval_shape(lambda: jax.vmap(self.bwd_one, (plan.w_axis, 0, 0, 0, 0, 0), **sched.stage_vmap)(
            self.weights, self.stage_keys(first), first, first, items, carry.fwd))
        # [S, K_w, n, ...] a shard's values by layer, or [S, K_w, mb, T, D] under two_vjps
        return carry._replace(w_stash=[self._zeros((s, self.k_weight, *a.shape[1:]), a.dtype, 2) for a in kept])

    def _zeros(self, shape, dtype, shard_dim):
        """Zeros split over `stage` (dim 0) and the batch shards (dim `shard_dim`)."""
        spec = ["stage", *[None] * (len(shape) - 1)]
        spec[shard_dim] = self.sched.plan.shard
        return jax.lax.with_sharding_constraint(jnp.zeros(shape, dtype), self.sched.plan.sharding(*spec))
