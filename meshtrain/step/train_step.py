"""The training and eval steps: pure functions, jitted with shardings and donation.

    train_step(state, batch) -> (state, metrics)
    eval_step(params, stats, batch) -> {"loss": [], and the task's eval metrics}

A batch is what the model's task says (meshtrain/step/tasks): token rows [B, T+1] int32 for a
language model, {"images", "labels"} for a classifier.

metrics, each a scalar: "loss" (mean over the batch), "grad_norm" (global L2
norm before clipping), "lr" (this step's), "nonfinite_grads" (gradient leaves holding a
NaN or Inf) and "first_nonfinite" (index into gradient_names(model) of the first, -1 for
none), and the task's own (a classifier's top1/top5 on the training batch);
train.nonfinite decides what the loop does with "nonfinite_grads" and "first_nonfinite"
(loop.py). A model with BatchStat state (BatchNorm) gets its running statistics from the
training forward pass; the optimizer never sees them.

With train.grad_accum_steps = k the batch is cut into k microbatches of B/k rows and
gradients are averaged over a `lax.scan`; the mean of k equal-size mean losses is
the full-batch mean loss, so k changes memory, not the result (BatchNorm aside: its
statistics are those of each microbatch, carried from one to the next, as on one device). With
accum_gather="once" and parameters sharded over a batch axis (fsdp):

    w = gather(cast(params))             # once, to the params' sharding without fsdp
    acc [n, ...] = 0 (float32)           # n = batch replicas, fsdp's included
    for each microbatch j:               # lax.scan; no collective on w inside
        acc += per-replica grads of loss(w, rows j)
    grads = sum over n of acc / k        # one reduce-scatter to the optimizer's sharding
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from meshtrain import tree_paths
from meshtrain.models.stack import is_matrix
from meshtrain.parallel import compression, grad_reduce, momentum_compression, offload as offload_lib
from meshtrain.parallel.hook import Constrain
from meshtrain.parallel.layouts import Layout
from meshtrain.parallel.pipeline import schedule_1f1b as pipeline_1f1b, schedule_zb as pipeline_zb
from meshtrain.parallel.pipeline import stages as pipeline_stages
from meshtrain.step import loss as loss_lib, programs, tasks
from meshtrain.step.state import ModelDef, TrainState
from meshtrain.step.tasks.task import is_field


def batch_sharding(layout: Layout, mesh: Mesh, fields=None):
    """Where a batch lives: a pytree of NamedSharding like `fields` (the task's
    `batch_fields`; default token rows [B, T+1]), each field laid out like the
    activations its logical axes name."""
    fields = tasks.Field((1, 1), "int32", ("batch", None)) if fields is None else fields
    return jax.tree.map(lambda f: NamedSharding(mesh, layout.spec(f.axes, "activations")), fields,
                        is_leaf=is_field)


def produced_dtypes(model: ModelDef) -> dict:
    """Params-shaped tree of the dtype the backward pass produces each gradient in: the
    compute dtype for matrices (make_cast), the param dtype for the rest."""
    cfg = model.cfg
    return jax.tree.map(lambda axes: cfg.dtype if is_matrix(axes) else cfg.param_dtype, model.axes,
                        is_leaf=lambda x: isinstance(x, tuple))


def replica_dtypes(model: ModelDef, grad_accum_steps: int) -> list:
    """The dtype each gradient leaf (jax.tree.leaves order) reaches a reduction by hand in:
    as produced, or float32 once summed over microbatches (`make_gradients`' accumulate)."""
    return [d if grad_accum_steps == 1 else "float32" for d in jax.tree.leaves(produced_dtypes(model))]


def make_cast(model: ModelDef, layout: Layout, mesh: Mesh,
              offload: offload_lib.Offload = offload_lib.Offload()) -> Callable:
    """params -> params with every matrix (two or more logical axes besides layers/stage:
    the weights matmuls read) in the compute dtype, still stored-sharded. Cast before any
    gather, FSDP gathers the compute dtype, half the bytes of float32 master weights, and
    each matrix's gradient arrives in the compute dtype where XLA reduces it. Vectors
    (norms, biases) stay in the param dtype: the models apply them in float32.
    Under `offload.params` the stacked layers stay in host memory (each layer arrives in
    the layer scan: offload.Arrival) and the rest is fetched to the device first."""
    dtype = jnp.dtype(model.cfg.dtype)
    same = dtype == jnp.dtype(model.cfg.param_dtype)

    def cast(p, axes):
        if same or not is_matrix(axes):
            return p
        return grad_reduce.constrain_both_ways(p.astype(dtype), NamedSharding(mesh, layout.spec(axes, "params")),
                                               NamedSharding(mesh, layout.spec(axes, "grads")))
    if not offload.params:
        return (lambda params: params) if same else (lambda params: jax.tree.map(cast, params, model.axes))

    def fetch_and_cast(params):
        rest = {k: v for k, v in params.items() if k != model.stacked}
        rest = jax.tree.map(cast, offload_lib.fetch(rest), {k: model.axes[k] for k in rest},
                            is_leaf=lambda x: isinstance(x, tuple))
        return {**rest, model.stacked: params[model.stacked]}
    return fetch_and_cast


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


def forward_parts(model: ModelDef, layout: Layout, mesh: Mesh,
                  offload: offload_lib.Offload = offload_lib.Offload()) -> tuple[Callable, Callable, Callable | None]:
    """(constrain, cast, run_layers): what every forward pass of `model` on `mesh` under
    `layout` takes (the layout's constrain hook, with the layers' arrival from host memory
    under `offload.params`; make_cast; and the pipeline's schedule
    when model.pipeline is set; else, under a layout that reduce-scatters gradients in
    the layer scan (ZeRO-2's `grads` table), the layers in order, each through
    grad_reduce.pinned_in_backward; else None: the model runs its layers itself)."""
    constrain = Constrain(layout, mesh, arrival=offload_lib.arrival(offload, model.cfg.dtype))
    cast = make_cast(model, layout, mesh, offload)
    if model.stacked is None:  # no stack of layers: nothing to pipeline or pin
        return constrain, cast, None
    blocks_axes = model.axes[model.stacked]
    pins = grad_reduce.grads_pins(layout, mesh, blocks_axes, 1 if model.pipeline is None else 2)
    run_layers = None
    if model.pipeline is not None:
        run_layers = pipeline_stages.make_runner(model.pipeline, layout, mesh, blocks_axes,
                                          scan_layers=model.cfg.scan_layers, grads_pins=pins)
    elif pins is not None:
        run_layers = grad_reduce.sequential_runner(pins, constrain, scan=model.cfg.scan_layers)
    return constrain, cast, run_layers


def make_objective(model: ModelDef, layout: Layout, mesh: Mesh, task: tasks.Task | None = None,
                   loss_chunk: int = 0, offload: offload_lib.Offload = offload_lib.Offload()) -> Callable:
    """objective(params, stats, batch, key, train=True) -> (mean loss, (metrics, stats)):
    the task's loss (tasks/) of the model bound to params and its BatchStat `stats`, the
    task's metrics ({name: []}) and the stats the forward pass leaves (updated when
    `train`), over chunks of loss_chunk positions when that is below T (step/loss.py; 0:
    whole). The forward takes its parts from forward_parts: pipelined when model.pipeline
    is set. Under a 1F1B or ZB schedule the loss is the same and its gradient comes from the
    tick loop (parallel/pipeline/schedule_1f1b.py, schedule_zb.py), with no metrics (a pipelined model has
    neither statistics nor auxiliary losses)."""
    task = tasks.for_family(model.task) if task is None else task
    constrain, cast, run_layers = forward_parts(model, layout, mesh, offload)

    def objective(params, stats, batch, key, train=True):
        module = model.bind(cast(params), stats)
        loss, metrics = task.loss(module, batch, key, run_layers, constrain=constrain, layout=layout,
                                  mesh=mesh, loss_chunk=loss_chunk, train=train)
        return loss, (metrics, model.stats_of(module) if model.stats_shapes else stats)
    if model.pipeline is None or not model.pipeline.one_f_one_b:
        return objective
    blocks_axes = model.axes[model.stacked]
    plan = pipeline_stages.stage_plan(model.pipeline, layout, mesh, blocks_axes,
                                      grad_reduce.grads_pins(layout, mesh, blocks_axes, 2))
    loss_fn = pipeline_1f1b.make_loss_fn(model, plan, lambda params, batch, key: objective(params, {}, batch, key)[0],
                                         constrain=constrain, cast=cast,
                                         head_loss=functools.partial(loss_lib.head_loss, loss_chunk=loss_chunk),
                                         documents=getattr(task, "documents", None),
                                         loop=pipeline_zb.ZeroBubbleLoop if model.pipeline.schedule == "zb" else None)
    return lambda params, stats, batch, key, train=True: (loss_fn(params, batch, key), ({}, stats))


NONFINITE_POLICIES = ("crash", "skip")


def norm_and_nonfinite(squares: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(global norm, [] int32 count, [] int32 index of the first) of gradient leaves holding
    a NaN or Inf, from one sum of squares per leaf ([leaves] float32: offload.leaf_squares),
    so the check adds no reduction or collective to the norm's; -1 when there is none.
    Leaves are in `gradient_names` order. A leaf whose squares overflow float32 counts as
    non-finite: its norm is Inf too."""
    bad = ~jnp.isfinite(squares)
    count = jnp.sum(bad).astype(jnp.int32)
    return jnp.sqrt(jnp.sum(squares)), count, jnp.where(count > 0, jnp.argmax(bad), -1).astype(jnp.int32)


def gradient_names(model: ModelDef) -> list[str]:
    """The parameter paths that metrics["first_nonfinite"] indexes."""
    return list(tree_paths.flat(model.shapes))


def make_gradients(model: ModelDef, layout: Layout, mesh: Mesh, shardings: TrainState, grad_shardings,
               task: tasks.Task, batches, *, grad_accum_steps: int, loss_chunk: int,
               reduction: grad_reduce.Reduction, offload: offload_lib.Offload, own_params: bool = False) -> Callable:
    """grads_and_loss(params, stats, comm, batch, key) -> (grads, loss, metrics, stats, comm):
    the objective's, averaged over k = grad_accum_steps microbatches (module docstring), the
    replicas' reduction done by hand where `replica_axes` says so (compressed with `comm`'s
    feedback buffers under train.grad_compression), else left to XLA. Sums
    are kept in float32 (gathered matrices' gradients arrive in the compute dtype); under
    a layout that splits gradients (ZeRO-2) they are kept where the moments live, never whole.
    `own_params` (DiLoCo): params [data, ...], each data replica's own, and the grads,
    loss and metrics are returned per replica [data, ...], unreduced. `shift` (c m,
    under train.compress_momentum): momentum_compression.reduce's."""
    k = grad_accum_steps
    gathered, replicas = reduction.axes(layout, mesh, shardings.params, k, bool(model.stats_shapes))
    if own_params:
        gathered, replicas = (), ("data",)
    # grad_fn(params, stats, batch, key) -> ((loss, (metrics, stats)), grads); per replica
    # (loss [n], grads [n, ...]), reduced below, when there are replica axes.
    objective = make_objective(model, layout.without(*replicas) if replicas else layout, mesh, task, loss_chunk,
                               offload)
    grad_fn = jax.value_and_grad(objective, has_aux=True)
    grad_fn = grad_reduce.per_replica(grad_fn, replicas, mesh, own_params) if replicas else grad_fn
    gather = make_gather(model, layout, mesh, gathered)
    micro_shardings = jax.tree.map(lambda sh: NamedSharding(mesh, P(None, *sh.spec)), batches)

    def pin(grads):
        return jax.lax.with_sharding_constraint(grads, grad_shardings) if layout.splits_grads else grads

    def accumulate(params, stats, batch, key):  # -> (mean grads, loss, metrics, stats) over k microbatches
        # Row i*k + j goes to microbatch j, so every device keeps its own rows.
        micro = jax.tree.map(lambda x, sh: jax.lax.with_sharding_constraint(
            x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1), sh), batch, micro_shardings)
        keys = None if key is None else jax.random.split(key, k)
        params = gather(params)
        (loss_shape, (metric_shapes, _)), grad_shapes = jax.eval_shape(
            grad_fn, params, stats, jax.tree.map(lambda x: x[0], micro), None if keys is None else keys[0])
        grads0, loss0, metrics0 = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.promote_types(s.dtype, jnp.float32)),
                                               (grad_shapes, loss_shape, metric_shapes))

        def body(carry, xs):
            (acc, loss_sum, metric_sum), stats = carry
            (loss, (metrics, stats)), grads = grad_fn(params, stats, *xs)
            # Offloaded params' gradients leave for the host layer by layer; the sum is kept
            # on the device (a float32 accumulator of full size, as without offload).
            grads = offload_lib.fetch(grads) if offload.params else grads
            acc = pin(jax.tree.map(lambda a, x: a + x.astype(a.dtype), acc, grads))
            metric_sum = jax.tree.map(lambda a, x: a + x.astype(a.dtype), metric_sum, metrics)
            return ((acc, loss_sum + loss, metric_sum), stats), None
        ((grads, loss, metrics), stats), _ = jax.lax.scan(body, ((pin(grads0), loss0, metrics0), stats), (micro, keys))
        # grad_reduce.reduce takes float32 sums to their reduction dtype; else back to the
        # dtype the backward produced.
        mean = jax.tree.map(lambda g, s: (g / k).astype(jnp.float32 if replicas else s.dtype), grads, grad_shapes)
        return mean, loss / k, jax.tree.map(lambda m: m / k, metrics), stats

    def grads_and_loss(params, stats, comm, batch, key, shift=None):
        if k == 1:
            (loss, (metrics, stats)), grads = grad_fn(params, stats, batch, key)
        else:
            grads, loss, metrics, stats = accumulate(params, stats, batch, key)
        if not replicas or own_params:
            return grads, loss, metrics, stats, comm
        # per-replica losses and metrics [n]; no stats (a model with them has no replica axes)
        if reduction.compression is not None:
            grads, comm = momentum_compression.reduce(grads, params, comm, reduction.compression, mesh, replicas,
                                                      compression.inner_specs(shardings.params, replicas), shift)
        else:
            grads = grad_reduce.reduce(grads, reduction.dtype or produced_dtypes(model), params)
        return grads, loss.mean(), jax.tree.map(jnp.mean, metrics), stats, comm
    return grads_and_loss


def make_train_step(model: ModelDef, tx: optax.GradientTransformation, schedule: optax.Schedule,
                    layout: Layout, mesh: Mesh, shardings: TrainState, grad_shardings, *,
                    grad_accum_steps: int = 1, nonfinite: str = "crash", loss_chunk: int = 0,
                    reduction: grad_reduce.Reduction = grad_reduce.Reduction(), task: tasks.Task | None = None,
                    batch_shardings=None, offload: offload_lib.Offload = offload_lib.Offload()) -> Callable:
    """Returns the jitted step. The keywords are the train.* keys of the same names
    (experiment.py passes them); `reduction` is train.grad_dtype's and train.accum_gather's
    (grad_reduce.Reduction.of, "auto" decided before).

    metrics["nonfinite_grads"] counts gradient leaves with a NaN or Inf and
    metrics["first_nonfinite"] indexes `gradient_names(model)` (-1: none). With
    nonfinite="skip", a step with a non-finite loss or gradient changes only the
    step counter.

    `shardings` is the TrainState of NamedShardings; `grad_shardings` (params-shaped)
    is where gradients are reduced to: the optimizer moments' shardings, so under
    FSDP and ZeRO-1 XLA reduce-scatters gradients instead of all-reducing them (ZeRO-1
    at the end of the backward pass; ZeRO-2 layer by layer inside it, forward_parts).
    With `reduction.dtype` set, the reduction over the data-parallel replicas is done by hand
    in that dtype, once per step (meshtrain/parallel/grad_reduce.py). With `reduction.gather="once"`
    and microbatches, parameters sharded over a batch axis are gathered once before the
    microbatch loop, and that axis joins the replica axes (module docstring). A model
    with BatchStat state accumulates without per-replica gradients (its statistics are
    over a microbatch's rows on every replica, as on one device), so XLA reduces each
    microbatch's gradients; `reduction.dtype` is refused for it (grad_reduce.check_stats).
    `batch_shardings` defaults to token rows' (batch_sharding); train.compress_momentum's
    warm-up is a program of its own (programs.Phased). `offload`: what
    train.offload keeps in host memory (`shardings` say so too: parallel/offload.py); the
    update then streams the stacked layers one at a time (offload.streamed_update) and the
    output shardings put it back. `tx`'s gradient clip (optim.clip_by_global_norm) is given
    the norm the metrics log, on every path.
    """
    task = tasks.for_family(model.task) if task is None else task
    batches = batch_sharding(layout, mesh) if batch_shardings is None else batch_shardings
    momentum = reduction.compression.momentum if reduction.compression is not None else None

    def jitted(reduction: grad_reduce.Reduction):
        grads_and_loss = make_gradients(model, layout, mesh, shardings, grad_shardings, task, batches,
                                        grad_accum_steps=grad_accum_steps, loss_chunk=loss_chunk,
                                        reduction=reduction, offload=offload)
        moved = reduction.compression.momentum if reduction.compression is not None else None
        streams = offload_lib.streams(offload, model)
        dropout_on = model.cfg.dropout > 0

        def train_step(state: TrainState, batch):
            key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step) if dropout_on else None
            shift = None if moved is None else moved.offset(state.opt_state)
            grads, loss, task_metrics, stats, comm = grads_and_loss(state.params, state.stats, state.comm, batch, key,
                                                                    shift)
            # Offloaded params' gradients left for host memory layer by layer: pinned there.
            placed = offload_lib.grads_shardings(offload, model, grad_shardings, grad_accum_steps)
            grads = jax.lax.with_sharding_constraint(grads, placed)
            grad_norm, count, first = norm_and_nonfinite(offload_lib.leaf_squares(
                grads, model.stacked, placed, streamed=offload_lib.grads_on_host(offload, model, grad_accum_steps)))
            good = jnp.isfinite(loss) & (count == 0) if nonfinite == "skip" else None
            if streams:  # the stacked layers' update one layer at a time, from and to host memory
                params, opt_state = offload_lib.streamed_update(
                    tx, grads, state.opt_state, state.params, stacked=model.stacked, offload=offload,
                    norm=grad_norm, good=good)
            else:  # offloaded optimizer state (a pipeline's, or a model's without a layer stack) fetched
                # whole; params offload always streams (offload.check_model refuses it elsewhere)
                old = (state.params, offload_lib.fetch(state.opt_state) if offload.opt_state else state.opt_state)
                updates, opt_state = tx.update(grads, old[1], old[0], global_norm=grad_norm)
                params = optax.apply_updates(old[0], updates)
                if good is not None:
                    params, opt_state = jax.tree.map(lambda o, new: jnp.where(good, new, o), old, (params, opt_state))
            if good is not None:  # a bad step leaves params, optimizer state and stats as they were
                stats = jax.tree.map(lambda old, new: jnp.where(good, new, old), state.stats, stats)
            metrics = {"loss": loss, "grad_norm": grad_norm, "lr": schedule(state.step),
                       "nonfinite_grads": count, "first_nonfinite": first, **task_metrics}
            return TrainState(step=state.step + 1, rng=state.rng, params=params, opt_state=opt_state,
                              stats=stats, comm=comm), metrics

        return jax.jit(train_step, in_shardings=(shardings, batches),
                       out_shardings=(shardings, NamedSharding(mesh, P())), donate_argnums=(0,))

    if momentum is None or momentum.warmup == 0:
        return jitted(reduction)
    exact = dataclasses.replace(reduction, compression=None, dtype="float32")  # compress_momentum's warm-up
    return programs.Phased(jitted(exact), jitted(reduction), momentum.warmup)


def make_eval_step(model: ModelDef, layout: Layout, mesh: Mesh, param_shardings, loss_chunk: int = 0,
                   task: tasks.Task | None = None, stats_shardings=None, batch_shardings=None,
                   offload: offload_lib.Offload = offload_lib.Offload()) -> Callable:
    """eval_step(params, stats, batch) -> {"loss": mean loss, and the task's eval metrics}
    (no dropout; BatchNorm uses its running statistics); params in host memory under
    `offload.params`, as they are stored."""
    objective = make_objective(model, layout, mesh, task, loss_chunk, offload)

    def eval_step(params, stats, batch):
        loss, (metrics, _) = objective(params, stats, batch, None, False)
        return {"loss": loss, **metrics}
    return jax.jit(eval_step, in_shardings=(param_shardings, {} if stats_shardings is None else stats_shardings,
                                            batch_sharding(layout, mesh) if batch_shardings is None else batch_shardings),
                   out_shardings=NamedSharding(mesh, P()))


def make_logits_step(model: ModelDef, layout: Layout, mesh: Mesh, param_shardings,
                     task: tasks.LanguageModelling | None = None,
                     offload: offload_lib.Offload = offload_lib.Offload()) -> Callable:
    """logits_step(params, tokens [B, T+1] int32) -> (logits [B, T, V padded] float32,
    weights [B, T] float32), without dropout: the model the loss takes, whole, on the
    inputs tokens[:, :-1] with the task's packing (a packed window's documents masked
    apart, tasks/language.py), and the weight the loss gives each target tokens[:, 1:]
    (1; 0 across a document's end under data.packing=documents), both in position order
    and laid out like the activations. So sum(weights * cross entropy(logits, targets))
    / (B T) is the eval step's loss. The model masks the logits of padding ids; callers
    strip them ([..., :model.cfg.vocab_size]). For parity checks (meshtrain eval
    --dump_logits): training never holds these [B, T, V] float32 logits when
    train.loss_chunk < T. `task` None: a language model packed as one stream (concat);
    `offload`: where the params are stored (their shardings' memory kind)."""
    task = tasks.LanguageModelling() if task is None else task
    constrain, cast, run_layers = forward_parts(model, layout, mesh, offload)

    def logits_step(params, tokens_bt1):
        # The task's documents: the same segment ids and positions its loss hands the model.
        docs_constrain, weights_bt = task.documents(tokens_bt1, constrain)
        logits_btv = model.bind(cast(params))(tokens_bt1[:, :-1], docs_constrain, None, run_layers)
        # Weights under either packing: one rule recomputes the loss from what is returned.
        weights_bt = jnp.ones(tokens_bt1[:, 1:].shape, jnp.float32) if weights_bt is None else weights_bt
        return logits_btv.astype(jnp.float32), weights_bt
    return jax.jit(logits_step, in_shardings=(param_shardings, batch_sharding(layout, mesh)),
                   out_shardings=(NamedSharding(mesh, layout.spec(("batch", "length", "vocab"), "activations")),
                                  NamedSharding(mesh, layout.spec(("batch", "length"), "activations"))))
