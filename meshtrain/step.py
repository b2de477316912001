"""The training and eval steps: pure functions, jitted with shardings and donation.

    train_step(state, tokens [B, T+1] int32) -> (state, metrics)
    eval_step(params, tokens [B, T+1] int32) -> mean loss over the B x T targets []

metrics, each a scalar: "loss" (mean over the batch's targets), "grad_norm" (global L2
norm before clipping), "lr" (this step's), "nonfinite_grads" (gradient leaves holding a
NaN or Inf) and "first_nonfinite" (index into gradient_names(model) of the first, -1 for
none); train.nonfinite decides what the loop does with the last two (loop.py).

With train.grad_accum_steps = k the batch is cut into k microbatches of B/k rows and
gradients are averaged over a `lax.scan`; the mean of k equal-size mean losses is
the full-batch mean loss, so k changes memory, not the result. With
accum_gather="once" and parameters sharded over a batch axis (fsdp):

    w = gather(cast(params))             # once, to the params' sharding without fsdp
    acc [n, ...] = 0 (float32)           # n = batch replicas, fsdp's included
    for each microbatch j:               # lax.scan; no collective on w inside
        acc += per-replica grads of loss(w, rows j)
    grads = sum over n of acc / k        # one reduce-scatter to the optimizer's sharding
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from meshtrain import grad_reduce, loss as loss_lib, pipeline, pipeline_1f1b
from meshtrain.layouts import Layout, make_constrain
from meshtrain.models.stack import is_matrix
from meshtrain.state import ModelDef, TrainState
from meshtrain import tree_paths


def batch_sharding(layout: Layout, mesh: Mesh) -> NamedSharding:
    """Where a batch of token rows [B, T+1] lives: rows split like the activations' batch."""
    return NamedSharding(mesh, layout.spec(("batch", None), "activations"))


def produced_dtypes(model: ModelDef) -> dict:
    """Params-shaped tree of the dtype the backward pass produces each gradient in: the
    compute dtype for matrices (make_cast), the param dtype for the rest."""
    cfg = model.cfg
    return jax.tree.map(lambda axes: cfg.dtype if is_matrix(axes) else cfg.param_dtype, model.axes,
                        is_leaf=lambda x: isinstance(x, tuple))


def make_cast(model: ModelDef, layout: Layout, mesh: Mesh) -> Callable:
    """params -> params with every matrix (two or more logical axes besides layers/stage:
    the weights matmuls read) in the compute dtype, still stored-sharded. Cast before any
    gather, FSDP gathers the compute dtype, half the bytes of float32 master weights, and
    each matrix's gradient arrives in the compute dtype where XLA reduces it. Vectors
    (norms, biases) stay in the param dtype: the models apply them in float32."""
    dtype = jnp.dtype(model.cfg.dtype)
    if dtype == jnp.dtype(model.cfg.param_dtype):
        return lambda params: params

    def cast(p, axes):
        if not is_matrix(axes):
            return p
        return grad_reduce.constrain_both_ways(p.astype(dtype), NamedSharding(mesh, layout.spec(axes, "params")),
                                               NamedSharding(mesh, layout.spec(axes, "grads")))
    return lambda params: jax.tree.map(cast, params, model.axes)


def make_gather(model: ModelDef, layout: Layout, mesh: Mesh, axes: tuple[str, ...]) -> Callable:
    """params -> params cast to the compute dtype (make_cast) and gathered over the mesh
    `axes`: stored at the layout's params sharding with `axes` struck. The identity when
    `axes` is empty. train.accum_gather="once" gathers so once per step."""
    if not axes:
        return lambda params: params
    cast, inner = make_cast(model, layout, mesh), layout.without(*axes)

    def gather_one(p, axes):
        return jax.lax.with_sharding_constraint(p, NamedSharding(mesh, inner.spec(axes, "params")))
    return lambda params: jax.tree.map(gather_one, cast(params), model.axes)


def forward_parts(model: ModelDef, layout: Layout, mesh: Mesh) -> tuple[Callable, Callable, Callable | None]:
    """(constrain, cast, run_layers): what every forward pass of `model` on `mesh` under
    `layout` takes (the layout's constrain hook, make_cast, and the pipeline's schedule
    when model.pipeline is set; else, under a layout that reduce-scatters gradients in
    the layer scan (ZeRO-2's `grads` table), the layers in order, each through
    grad_reduce.pinned_in_backward; else None: the model runs its layers itself)."""
    blocks_axes = model.axes[model.stacked]
    constrain = make_constrain(layout, mesh)
    pins = grad_reduce.grads_pins(layout, mesh, blocks_axes, 1 if model.pipeline is None else 2)
    run_layers = None
    if model.pipeline is not None:
        run_layers = pipeline.make_runner(model.pipeline, layout, mesh, blocks_axes,
                                          scan_layers=model.cfg.scan_layers, grads_pins=pins)
    elif pins is not None:
        run_layers = grad_reduce.sequential_runner(pins, constrain, scan=model.cfg.scan_layers)
    return constrain, make_cast(model, layout, mesh), run_layers


def make_loss_fn(model: ModelDef, layout: Layout, mesh: Mesh, loss_chunk: int = 0) -> Callable:
    """loss_fn(params, tokens [B, T+1], key) -> mean loss; pipelined when model.pipeline is set,
    over chunks of loss_chunk positions when that is below T (meshtrain/loss.py; 0: whole)."""
    constrain, cast, run_layers = forward_parts(model, layout, mesh)

    def loss_fn(params, tokens_bt1, key):
        inputs, targets = tokens_bt1[:, :-1], tokens_bt1[:, 1:]
        return loss_lib.next_token_loss(model.bind(cast(params)), inputs, targets, key, run_layers,
                                        constrain=constrain, layout=layout, mesh=mesh,
                                        loss_chunk=loss_chunk)
    if model.pipeline is None or not model.pipeline.one_f_one_b:
        return loss_fn
    # 1f1b, interleaved: the same loss, whose gradient comes from the tick loop.
    blocks_axes = model.axes[model.stacked]
    plan = pipeline.stage_plan(model.pipeline, layout, mesh, blocks_axes,
                               grad_reduce.grads_pins(layout, mesh, blocks_axes, 2))
    return pipeline_1f1b.make_loss_fn(model, plan, loss_fn, constrain=constrain, cast=cast,
                                      loss_chunk=loss_chunk)


NONFINITE_POLICIES = ("crash", "skip")


def norm_and_nonfinite(grads) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(global norm, [] int32 count, [] int32 index of the first) of gradient leaves holding
    a NaN or Inf, from one sum of squares per leaf, so the check adds no reduction or
    collective to the norm's; -1 when there is none. Leaves are in `gradient_names` order.
    A leaf whose squares overflow float32 counts as non-finite: its norm is Inf too."""
    squares = jnp.stack([jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads)])
    bad = ~jnp.isfinite(squares)
    count = jnp.sum(bad).astype(jnp.int32)
    return jnp.sqrt(jnp.sum(squares)), count, jnp.where(count > 0, jnp.argmax(bad), -1).astype(jnp.int32)


def gradient_names(model: ModelDef) -> list[str]:
    """The parameter paths that metrics["first_nonfinite"] indexes."""
    return list(tree_paths.flat(model.shapes))


def make_train_step(model: ModelDef, tx: optax.GradientTransformation, schedule: optax.Schedule,
                    layout: Layout, mesh: Mesh, shardings: TrainState, grad_shardings, *,
                    microbatches: int, nonfinite: str = "crash", loss_chunk: int = 0,
                    grad_dtype: str = "", accum_gather: str = "each") -> Callable:
    """Returns the jitted step.

    metrics["nonfinite_grads"] counts gradient leaves with a NaN or Inf and
    metrics["first_nonfinite"] indexes `gradient_names(model)` (-1: none). With
    nonfinite="skip", a step with a non-finite loss or gradient changes only the
    step counter.

    `shardings` is the TrainState of NamedShardings; `grad_shardings` (params-shaped)
    is where gradients are reduced to: the optimizer moments' shardings, so under
    FSDP and ZeRO-1 XLA reduce-scatters gradients instead of all-reducing them (ZeRO-1
    at the end of the backward pass; ZeRO-2 layer by layer inside it, forward_parts).
    With `grad_dtype` set, the reduction over the data-parallel replicas is done by hand
    in that dtype, once per step (meshtrain/grad_reduce.py). With `accum_gather="once"`
    and microbatches, parameters sharded over a batch axis are gathered once before the
    microbatch loop, and that axis joins the replica axes (module docstring).
    """
    by_hand = bool(grad_dtype) or microbatches > 1
    split_in_backward = layout.splits_grads  # ZeRO-2: accumulate split, never whole
    gathered = grad_reduce.gathered_axes(layout, mesh, shardings.params, microbatches, accum_gather)
    replicas = grad_reduce.replica_axes(layout, mesh, shardings.params, gathered) if by_hand else ()
    gather = make_gather(model, layout, mesh, gathered)
    if replicas:  # loss [n] and grads [n, ...], one per replica, reduced below
        inner = layout.without(*replicas)
        grad_fn = grad_reduce.per_replica(
            jax.value_and_grad(make_loss_fn(model, inner, mesh, loss_chunk)), replicas, mesh)
    else:
        grad_fn = jax.value_and_grad(make_loss_fn(model, layout, mesh, loss_chunk))
    batches = batch_sharding(layout, mesh)
    micro_sharding = NamedSharding(mesh, layout.spec((None, "batch", None), "activations"))
    dropout_on = model.cfg.dropout > 0

    def summed_grads(params, tokens, key):
        if microbatches == 1:
            loss, grads = grad_fn(params, tokens, key)
            return grads, loss
        b, t1 = tokens.shape
        # Row i*k + j goes to microbatch j, so every device keeps its own rows.
        micro = tokens.reshape(b // microbatches, microbatches, t1).swapaxes(0, 1)
        micro = jax.lax.with_sharding_constraint(micro, micro_sharding)
        keys = None if key is None else jax.random.split(key, microbatches)
        params = gather(params)
        shapes = jax.eval_shape(grad_fn, params, micro[0], None if keys is None else keys[0])
        # Accumulated in float32 (gathered matrices' gradients arrive in the compute dtype).
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.promote_types(s.dtype, jnp.float32)), shapes)
        if split_in_backward:
            zeros = (zeros[0], jax.lax.with_sharding_constraint(zeros[1], grad_shardings))

        def body(acc, xs):
            mb, k = xs
            loss, grads = grad_fn(params, mb, k)
            acc = jax.tree.map(lambda a, x: a + x.astype(a.dtype), acc, (grads, loss))
            if split_in_backward:  # ZeRO-2: accumulate where the moments live, never whole
                acc = (jax.lax.with_sharding_constraint(acc[0], grad_shardings), acc[1])
            return acc, None
        (grads, loss), _ = jax.lax.scan(body, (zeros[1], zeros[0]), (micro, keys))
        # grad_reduce.reduce takes the float32 sums to their reduction dtype; else back to
        # the dtype the backward produced.
        mean = jax.tree.map(lambda g, s: (g / microbatches).astype(jnp.float32 if replicas else s.dtype),
                            grads, shapes[1])
        return mean, loss / microbatches

    def grads_and_loss(params, tokens, key):
        grads, loss = summed_grads(params, tokens, key)
        if replicas:
            return grad_reduce.reduce(grads, grad_dtype or produced_dtypes(model), params), loss.mean()
        return grads, loss

    def train_step(state: TrainState, tokens: jax.Array):
        key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step) if dropout_on else None
        grads, loss = grads_and_loss(state.params, tokens, key)
        grads = jax.lax.with_sharding_constraint(grads, grad_shardings)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        grad_norm, count, first = norm_and_nonfinite(grads)
        if nonfinite == "skip":  # a bad step leaves params and optimizer state as they were
            good = jnp.isfinite(loss) & (count == 0)
            params, opt_state = jax.tree.map(lambda old, new: jnp.where(good, new, old),
                                             (state.params, state.opt_state), (params, opt_state))
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": schedule(state.step),
                   "nonfinite_grads": count, "first_nonfinite": first}
        return TrainState(step=state.step + 1, rng=state.rng, params=params, opt_state=opt_state), metrics

    replicated = NamedSharding(mesh, P())
    return jax.jit(train_step, in_shardings=(shardings, batches),
                   out_shardings=(shardings, replicated), donate_argnums=(0,))


def make_eval_step(model: ModelDef, layout: Layout, mesh: Mesh, param_shardings,
                   loss_chunk: int = 0) -> Callable:
    """eval_step(params, tokens [B, T+1]) -> mean loss (no dropout)."""
    loss_fn = make_loss_fn(model, layout, mesh, loss_chunk)
    return jax.jit(lambda params, tokens: loss_fn(params, tokens, None),
                   in_shardings=(param_shardings, batch_sharding(layout, mesh)),
                   out_shardings=NamedSharding(mesh, P()))


def make_logits_step(model: ModelDef, layout: Layout, mesh: Mesh, param_shardings) -> Callable:
    """logits_step(params, tokens [B, T] int32) -> float32 logits [B, T, V padded] (no
    dropout): the model the loss takes, whole, laid out like the activations ("batch",
    "length", "vocab"). The model masks the logits of padding ids; callers strip them
    ([..., :model.cfg.vocab_size]). For parity checks (meshtrain eval --dump_logits):
    training never holds these [B, T, V] float32 logits when train.loss_chunk < T."""
    constrain, cast, run_layers = forward_parts(model, layout, mesh)

    def logits_step(params, tokens_bt):
        return model.bind(cast(params))(tokens_bt, constrain, None, run_layers).astype(jnp.float32)
    return jax.jit(logits_step, in_shardings=(param_shardings, batch_sharding(layout, mesh)),
                   out_shardings=NamedSharding(mesh, layout.spec(("batch", "length", "vocab"), "activations")))
