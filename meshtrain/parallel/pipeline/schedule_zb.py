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
gradient needs, W the rest, reading B's values, so no matmul runs twice; B starts from
each layer's residuals (stash=residuals) or runs the chunk forward again from its input
(stash=inputs). "two_vjps" takes one pullback for dx and another for the weights'
gradients, which runs the forward and the cotangent chain again: W keeps the chunk's
input and g.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from meshtrain.parallel.pipeline.schedule_1f1b import Carry, TickLoop, stash_zeros
from meshtrain.parallel.pipeline.ticks import backward_u, weight_items, weight_stash_slots, weight_u


class ZeroBubbleLoop(TickLoop):
    """The tick loop of schedule zb: B in the backward slot, W in a weight slot."""

    def __init__(self, sched, params, tokens_bt1, key):
        super().__init__(sched, params, tokens_bt1, key)
        self.k_weight = weight_stash_slots(sched.pipe)
        self.by_layer = sched.pipe.split == "jaxpr"

    # -- one stage, one item -----------------------------------------------------------

    def fwd_one(self, w, k, i, m, x):
        """-> (y, the leaves to stash): 1F1B's, and the chunk's input for two_vjps' W."""
        y, items = super().fwd_one(w, k, i, m, x)
        return y, items if self.by_layer or self.sched.pipe.stash == "inputs" else [*items, x]

    def bwd_one(self, w, k, i, m, items, g):
        """B: -> ((the weight gradients B made, or None; what W needs), dx)."""
        plan, stash = self.sched.plan, self.sched.pipe.stash
        wi, g_rows = plan.select(w, i), plan.rows(g)
        if self.by_layer:
            layers, k_m = self.layers(wi, k, m, g_rows)
            res = layers.forward(wi, k_m, plan.rows(items[0]))[1] if stash == "inputs" else items
            dx, dw, kept = layers.input_grads(wi, res, g_rows)
            return (dw, kept), plan.unrows(dx)
        if stash == "inputs":
            x, (dx,) = items[0], jax.vjp(lambda x: self.chunk(wi, k, m, x), items[0])[1](g)
        else:  # the fused pullback, its weight gradients unused
            x, dx = items[-1], plan.unrows(self.layers(wi, k, m, g_rows)[0].backward(wi, items[:-1], g_rows)[0])
        return (None, [x, g]), dx

    def w_one(self, w, k, i, m, kept):
        """W: -> d chunk weights, like the chunk's (or their flat list, None where B made them)."""
        plan = self.sched.plan
        wi = plan.select(w, i)
        if not self.by_layer:
            x, g = kept
            return jax.vjp(lambda wi: self.chunk(wi, k, m, x), wi)[1](g)[0]
        x_rows = jax.ShapeDtypeStruct((plan.n_shards, self.mb // plan.n_shards, self.t, self.inputs.shape[-1]),
                                      self.inputs.dtype)
        return self.layers(wi, k, m, x_rows)[0].weight_grads(wi, kept)

    # -- the slots ------------------------------------------------------------------------

    def keep_weight_part(self, carry: Carry, weight_part, t_now, valid, i) -> Carry:
        """The weight gradients B made, added up; B's values for W, kept in slot u mod K_w of
        each stage's weight stash."""
        dw, kept = weight_part
        if dw is not None:  # zeros where the slot was idle (g = 0)
            carry = self.add_dw(carry, dw, i)
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
        """1F1B's zeros, and the weight stash [S, K_w, ...] shaped from a trace of the
        backward slot."""
        carry = super().start()
        sched, plan, s = self.sched, self.sched.plan, self.sched.pipe.stages
        first = jnp.zeros(s, int)
        (_, kept), _ = jax.eval_shape(lambda: jax.vmap(self.bwd_one, (plan.w_axis, 0, 0, 0, 0, 0), **sched.stage_vmap)(
            self.weights, self.stage_keys(first), first, first, [a[:, 0, 0] for a in carry.stash], carry.fwd))
        return carry._replace(w_stash=[stash_zeros(plan, (s, self.k_weight, *a.shape[1:]), a.dtype) for a in kept])
