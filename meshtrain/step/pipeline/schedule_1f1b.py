"""1F1B and interleaved 1F1B in one SPMD program: the loss and its gradients from one tick
loop in which every stage runs a forward slot and a backward slot per tick.

Under gpipe and circular (meshtrain/step/pipeline/scan.py) the backward pass is autodiff of the
forward ticks, so each stage keeps every microbatch's activations until all forwards
are done. Here the backward is written per stage: the loss head runs on the last
stage's output inside the loop, so microbatch m's backward starts on the tick its
forward ends, and a stage keeps an item only between its two slots
(meshtrain/step/pipeline/ticks.py gives the schedule and counts them):

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
without a gradient) runs the forward-only ticks of meshtrain/step/pipeline/scan.py, whose storage
order and keys are the same, and its forward under autodiff runs the tick loop and
keeps the gradients for the backward to scale by the loss's cotangent.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from meshtrain.errors import UserError
from meshtrain.layouts import Layout
from meshtrain.models import family, stack
from meshtrain.models.stack import layer_maker
from meshtrain.parallel.hook import Constrain
from meshtrain.step import loss as loss_lib
from meshtrain.step.pipeline.scan import StagePlan
from meshtrain.step.pipeline.ticks import backward_items, forward_items, phases, stash_slots


def head_layout(inner: Layout, mesh_shape, padded_vocab: int) -> Layout:
    """`inner` (the layout a stage sees) with `stage` added to the activations' vocab rule,
    first, when the padded vocabulary divides over it: the head's logits split over the
    stages. Else `inner`, and every stage computes the whole head."""
    axes = (*dict(inner.activations).get("vocab", ()), "stage")
    if padded_vocab % math.prod(mesh_shape[a] for a in axes):
        return inner
    acts = (("vocab", axes), *((n, a) for n, a in inner.activations if n != "vocab"))
    return dataclasses.replace(inner, name=f"{inner.name}, vocab over stage", activations=acts)


def make_loss_and_grads(model, plan: StagePlan, *, constrain: Constrain, cast: Callable,
                        loss_chunk: int) -> Callable:
    """(params, tokens [B, T+1], key) -> (mean loss, grads like params) by the tick loop."""
    pipe, mesh = plan.pipe, plan.mesh
    if not family.implements(model.family.module, family.PipelineEnds):
        raise UserError(
            f"pipeline.schedule={pipe.schedule}: model family {model.family.name!r} does not split its "
            f"forward pass into embed_tokens and head (docs/models.md, the model seam), which the 1F1B "
            f"tick loop runs apart. Use pipeline.schedule={'circular' if pipe.repeats > 1 else 'gpipe'}, "
            f"or give the family those two methods.")
    s, v, n_micro, n = pipe.stages, pipe.repeats, pipe.microbatches, plan.n_shards
    shard, stacked_key = plan.shard, model.stacked
    k_slots = stash_slots(pipe)
    hl = head_layout(plan.inner, mesh.shape, model.cfg.padded_vocab_size)
    head_constrain = Constrain(hl, mesh)
    slot = plan.slot_spec()
    head_in = plan.sharding(shard, *slot.spec[2:])   # the last stage's y, on every stage

    def copies_spec(axes):  # one copy per batch shard of a head param, as compute wants it
        return plan.sharding(shard, *hl.spec(axes, "activations"))

    def loss_and_grads(params, tokens_bt1, key):
        inputs_bt, targets_bt = tokens_bt1[:, :-1], tokens_bt1[:, 1:]
        b, t = inputs_bt.shape
        mb = b // n_micro
        k_embed, k_layers = (None, None) if key is None else tuple(jax.random.split(key))
        head_axes = {k: a for k, a in model.axes.items() if k != stacked_key}

        def prepare(params):
            cast_params = cast(params)
            module = model.bind(cast_params)
            inputs = plan.inputs(module.embed_tokens(inputs_bt, constrain, k_embed))
            weights = plan.weights(cast_params[stacked_key])
            head = {k: p for k, p in cast_params.items() if k != stacked_key}
            head = jax.tree.map(lambda p, axes: jax.lax.with_sharding_constraint(
                jnp.broadcast_to(p[None], (n, *p.shape)), copies_spec(axes)), head, head_axes)
            return inputs, weights, head

        (inputs, weights, head), prepare_vjp = jax.vjp(prepare, params)
        keys = plan.keys(k_layers, params[stacked_key])
        make_layer, _ = layer_maker(getattr(model.bind(params), stacked_key), model.cfg.remat)
        chunk = plan.chunk_fn(make_layer, scan_layers=model.cfg.scan_layers)
        # embed_tokens put the positions in the layout's storage order (context parallelism,
        # layouts/sequence.py); the targets follow them.
        targets_bt = stack.stored(targets_bt, constrain)
        targets = targets_bt.reshape(mb, n_micro, t).swapaxes(0, 1)  # [M, mb, T], rows as inputs
        chunks = loss_lib.num_chunks(t, loss_chunk)
        blocks_const = params[stacked_key]

        def shard_head(head_params, x_btd, y_bt):  # one batch shard -> summed loss over its targets
            bound = model.bind({**head_params, stacked_key: blocks_const})
            h_btd, w = bound.head(x_btd, head_constrain)
            if chunks == 1 or not loss_lib.has_seam(bound):
                mean = loss_lib.cross_entropy(bound.project(h_btd, w, head_constrain), y_bt)
            else:
                mean = loss_lib.chunked_cross_entropy(bound.project, h_btd, w, y_bt, chunks, hl, mesh)
            return mean * y_bt.size

        head_grad = jax.vmap(jax.value_and_grad(shard_head, argnums=(0, 1)), spmd_axis_name=shard)

        def stage_keys(i):  # per stage [S]: chunk i's keys (the chunk folds in the microbatch)
            return None if keys is None else jax.vmap(lambda k, i: k[i])(keys, i)

        pullback = {}  # "residuals": the pullback's structure, recorded where it is traced

        def fwd_one(w, k, i, m, x):  # one stage's forward slot -> (y, what to stash)
            wi = plan.select(w, i)
            if pipe.stash == "inputs":
                return chunk(wi, k, m, x), [x]
            y, pull = jax.vjp(lambda wi, x: chunk(wi, k, m, x), wi, x)
            # The pullback's leaves are autodiff's residuals. Those that are the chunk's
            # weights or keys themselves are the same for every item: taken again at the
            # backward slot, not stashed K times.
            leaves, pullback["tree"] = jax.tree.flatten(pull)
            shared = jax.tree.leaves((wi, k))
            pullback["from"] = [next((j for j, a in enumerate(shared) if a is leaf), None) for leaf in leaves]
            return y, [leaf for leaf, j in zip(leaves, pullback["from"]) if j is None]

        def bwd_one(w, k, i, m, items, g):  # one stage's backward slot: (d chunk weights, dx)
            wi = plan.select(w, i)
            if pipe.stash == "inputs":
                _, pull = jax.vjp(lambda wi, x: chunk(wi, k, m, x), wi, items[0])
            else:
                shared, stashed = jax.tree.leaves((wi, k)), iter(items)
                pull = jax.tree.unflatten(pullback["tree"], [
                    next(stashed) if j is None else shared[j] for j in pullback["from"]])
            return pull(g)

        stage_vmap = dict(spmd_axis_name="stage")
        w_axis = plan.w_axis

        def forward_slot(carry, t_now):
            fv, fi, fm = forward_items(pipe, t_now, jnp)
            fresh = jax.lax.dynamic_index_in_dim(inputs, fm[0], 1, keepdims=False)  # stage 0's
            first = ((jnp.arange(s) == 0) & (fi == 0))[:, None, None, None]
            x = jnp.where(first, fresh, jnp.roll(carry["fwd"], 1, axis=0))
            x = jax.lax.with_sharding_constraint(x, slot)
            y, items = jax.vmap(fwd_one, (w_axis, 0, 0, 0, 0), **stage_vmap)(
                weights, stage_keys(fi), fi, fm, x)
            y = jax.lax.with_sharding_constraint(y, slot)

            def store(stash_s, valid, i, m, item):  # one stage keeps an item in slot (i, m mod K)
                old = stash_s[i, m % k_slots]
                return stash_s.at[i, m % k_slots].set(jnp.where(valid, item, old))
            stash = [jax.vmap(store, **stage_vmap)(st, fv, fi, fm, item)
                     for st, item in zip(carry["stash"], items)]
            return {**carry, "fwd": y, "stash": stash}, (fv, fi, fm, y)

        def head_slot(carry, fwd_items):
            fv, fi, fm, y = fwd_items
            valid = fv[s - 1] & (fi[s - 1] == v - 1)
            y_last = jax.lax.with_sharding_constraint(y[s - 1], head_in)
            tgt = jax.lax.dynamic_index_in_dim(targets, fm[s - 1], 0, keepdims=False)
            loss_n, (d_head, dy) = head_grad(head, y_last.reshape(n, mb // n, t, -1), tgt.reshape(n, mb // n, t))
            scale = jnp.where(valid, 1.0 / (b * t), 0.0)
            acc = jax.tree.map(lambda a, d: a + scale * d.astype(a.dtype), carry["d_head"], d_head)
            dy = (dy.reshape(mb, t, -1) * scale).astype(y.dtype)
            return {**carry, "d_head": acc, "loss": carry["loss"] + scale * loss_n.sum()}, dy

        def backward_slot(carry, t_now, dy):
            bv, bi, bm = backward_items(pipe, t_now, jnp)
            g = jnp.roll(carry["bwd"], -1, axis=0)
            if dy is not None:
                last = ((jnp.arange(s) == s - 1) & (bi == v - 1))[:, None, None, None]
                g = jnp.where(last, dy[None], g)
            g = jax.lax.with_sharding_constraint(jnp.where(bv[:, None, None, None], g, 0), slot)
            items = [jax.vmap(lambda st, i, m: st[i, m % k_slots], **stage_vmap)(st, bi, bm)
                     for st in carry["stash"]]
            dw, dx = jax.vmap(bwd_one, (w_axis, 0, 0, 0, 0, 0), **stage_vmap)(
                weights, stage_keys(bi), bi, bm, items, g)
            dx = jax.lax.with_sharding_constraint(dx, slot)

            def add(acc, d):  # acc [.., S, v, Lc, ...] += d [.., S, Lc, ...] at each stage's i
                def one(acc_s, d_s, i):
                    if plan.copies:
                        return acc_s.at[:, i].add(d_s.astype(acc_s.dtype))
                    return acc_s.at[i].add(d_s.astype(acc_s.dtype))
                return jax.vmap(one, (w_axis, 0, 0), w_axis, **stage_vmap)(acc, d, bi)
            d_w = jax.tree.map(add, carry["d_w"], dw)

            def keep_dx(d_in_s, is_first, m, dx_s):  # stage 0, repeat 0: d inputs[m]
                return d_in_s.at[m].set(jnp.where(is_first, dx_s, d_in_s[m]))
            is_first = (jnp.arange(s) == 0) & (bi == 0) & bv
            d_inputs = jax.vmap(keep_dx, **stage_vmap)(carry["d_inputs"], is_first, bm, dx)
            return {**carry, "bwd": dx, "d_w": d_w, "d_inputs": d_inputs}

        def warm_up(carry, t_now):
            return forward_slot(carry, t_now)[0], None

        def steady(carry, t_now):
            carry, fwd_items = forward_slot(carry, t_now)
            carry, dy = head_slot(carry, fwd_items)
            return backward_slot(carry, t_now, dy), None

        def cool_down(carry, t_now):
            return backward_slot(carry, t_now, None), None

        zeros_slot = jax.lax.with_sharding_constraint(jnp.zeros((s, mb, t, inputs.shape[-1]), inputs.dtype), slot)
        stash_spec = plan.sharding(slot.spec[0], None, None, *slot.spec[1:])

        def stash_zeros():  # [S, v, K, *item] per stashed leaf, from the forward slot's shapes
            _, items = jax.eval_shape(lambda: jax.vmap(fwd_one, (w_axis, 0, 0, 0, 0), **stage_vmap)(
                weights, stage_keys(jnp.zeros(s, int)), jnp.zeros(s, int),
                jnp.zeros(s, int), zeros_slot))
            if pipe.stash == "inputs":
                return [jax.lax.with_sharding_constraint(
                    jnp.zeros((s, v, k_slots, *items[0].shape[1:]), inputs.dtype), stash_spec)]
            return [jax.lax.with_sharding_constraint(jnp.zeros((s, v, k_slots, *a.shape[1:]), a.dtype),
                                                     plan.sharding("stage")) for a in items]
        f32 = lambda a: jnp.zeros(a.shape, jnp.promote_types(a.dtype, jnp.float32))  # noqa: E731
        carry = {
            "fwd": zeros_slot, "bwd": zeros_slot, "loss": jnp.zeros((), jnp.float32),
            "stash": stash_zeros(),
            "d_w": jax.tree.map(lambda a, axes: jax.lax.with_sharding_constraint(f32(a), plan.weight_sharding(axes)),
                                weights, plan.blocks_axes),
            "d_head": jax.tree.map(f32, head),
            "d_inputs": jnp.zeros_like(inputs),
        }
        warm, steady_n, cool = phases(pipe)
        unroll = lambda k: max(k, 1) if pipe.unroll else 1  # noqa: E731
        carry, _ = jax.lax.scan(warm_up, carry, jnp.arange(warm), unroll=unroll(warm))
        carry, _ = jax.lax.scan(steady, carry, warm + jnp.arange(steady_n), unroll=unroll(steady_n))
        carry, _ = jax.lax.scan(cool_down, carry, warm + steady_n + jnp.arange(cool), unroll=unroll(cool))
        cotangents = (carry["d_inputs"],
                      jax.tree.map(lambda d, w: d.astype(w.dtype), carry["d_w"], weights),
                      jax.tree.map(lambda d, h: d.astype(h.dtype), carry["d_head"], head))
        (grads,) = prepare_vjp(cotangents)
        return carry["loss"], grads

    return loss_and_grads


def make_loss_fn(model, plan: StagePlan, forward_loss: Callable, *, constrain: Constrain,
                 cast: Callable, loss_chunk: int) -> Callable:
    """loss_fn(params, tokens [B, T+1], key) -> mean loss: `forward_loss` (the forward-only
    ticks) when no gradient is taken, the tick loop's loss and gradients under autodiff."""
    loss_and_grads = make_loss_and_grads(model, plan, constrain=constrain, cast=cast, loss_chunk=loss_chunk)

    @jax.custom_vjp
    def loss_fn(params, tokens, key):
        return forward_loss(params, tokens, key)

    def fwd(params, tokens, key):
        return loss_and_grads(params, tokens, key)

    def bwd(grads, g):
        return jax.tree.map(lambda d: (g * d).astype(d.dtype), grads), None, None

    loss_fn.defvjp(fwd, bwd)
    return loss_fn
