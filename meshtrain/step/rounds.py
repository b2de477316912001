"""DiLoCo's steps (diloco.every = H > 0; the scheme in meshtrain/parallel/diloco.py): an
inner step every step, an outer step after every H-th (a fragment's, under
diloco.fragments), and the metrics' mean, jitted programs behind one callable the loop
calls like the train step (step/programs.py):

    rounds(state, batch) -> (state, metrics)

metrics as train_step's ("loss", "grad_norm", "lr", "nonfinite_grads",
"first_nonfinite", and the task's), each the mean over the data replicas (the
non-finite counts: the most of any replica). Two programs, not a `lax.cond` in one, so
that an inner step's HLO holds no collective across nodes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from meshtrain.parallel import diloco, grad_reduce, offload as offload_lib
from meshtrain.parallel.layouts import Layout
from meshtrain.step import tasks
from meshtrain.step.programs import Programs
from meshtrain.step.state import ModelDef, TrainState
from meshtrain.step.train_step import make_gradients, norm_and_nonfinite


@dataclasses.dataclass
class Rounds(Programs):
    """The round's three programs (jitted, or compiled: `compile`): the inner step every
    step, a fragment's outer step after its rounds' last, the metrics' mean. What is read
    of a compiled step is the inner step's, the one that runs every step (the outer
    step's cost is per round: planner/bounds.py)."""

    inner: Any
    outer: tuple     # a program a fragment (one without diloco.fragments)
    metrics: Any
    dil: diloco.Diloco

    @property
    def _main(self):
        return self.inner

    def _run(self, state: TrainState, batch, step: int) -> tuple[TrainState, dict]:
        state, metrics = self.inner(state, batch)
        for fragment in self.dil.due(step + 1):
            state = self.outer[fragment](state)
        return state, self.metrics(metrics)

    def compile(self, state, batch, options=None) -> "Rounds":
        """The three programs compiled from shapes (`state`, `batch`: ShapeDtypeStructs)."""
        inner = self.inner.lower(state, batch).compile(options)
        metrics = jax.eval_shape(self.inner, state, batch)[1]
        return Rounds(inner, tuple(o.lower(state).compile(options) for o in self.outer),
                      self.metrics.lower(metrics).compile(options), self.dil)


def make_rounds(model: ModelDef, inner_tx: optax.GradientTransformation,
                schedule: optax.Schedule, layout: Layout, mesh: Mesh, shardings: TrainState, param_shardings,
                dil: diloco.Diloco, *, grad_accum_steps: int, nonfinite: str, loss_chunk: int, task: tasks.Task,
                batch_shardings) -> Rounds:
    """The run's Rounds: `inner_tx` optim.*'s (the outer optimizer is dil's),
    `param_shardings` the layout's (one replica's params)."""
    grads_and_loss = make_gradients(model, layout, mesh, shardings, param_shardings, task, batch_shardings,
                                grad_accum_steps=grad_accum_steps, loss_chunk=loss_chunk,
                                reduction=grad_reduce.Reduction(), offload=offload_lib.Offload(), own_params=True)
    dropout_on = model.cfg.dropout > 0
    n = dil.replicas

    def inner_step(state: TrainState, batch):
        key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step) if dropout_on else None
        params, opt_state = state.comm["params"], state.comm["opt_state"]
        grads, loss, task_metrics, stats, _ = grads_and_loss(params, state.stats, {}, batch, key)
        grads = diloco.island_mean(grads, dil, mesh, param_shardings, model.shapes)
        squares = jax.vmap(lambda g: jnp.stack([jnp.sum(jnp.square(x.astype(jnp.float32)))
                                                 for x in jax.tree.leaves(g)]))(grads)
        grad_norm, count, first = jax.vmap(norm_and_nonfinite)(squares)
        updates, new_opt = jax.vmap(inner_tx.update)(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        if nonfinite == "skip":  # a replica whose step is bad keeps its params and optimizer state
            good = jnp.isfinite(loss) & (count == 0)
            keep = lambda old, new: jnp.where(good.reshape(-1, *[1] * (new.ndim - 1)), new, old)  # noqa: E731
            new_params, new_opt = jax.tree.map(keep, (params, opt_state), (new_params, new_opt))
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": jnp.full((n,), schedule(state.step)),
                   "nonfinite_grads": count, "first_nonfinite": first, **task_metrics}
        return state.replace(step=state.step + 1, stats=stats,
                             comm={**state.comm, "params": new_params, "opt_state": new_opt}), metrics

    def outer_step(state: TrainState, fragment: int) -> TrainState:
        params, comm = diloco.outer_update(dil, state.params, state.comm, mesh, param_shardings, model.stacked,
                                           fragment)
        return state.replace(params=params, comm=comm)

    per_replica = NamedSharding(mesh, P(diloco.AXIS))
    return Rounds(jax.jit(inner_step, in_shardings=(shardings, batch_shardings), out_shardings=(shardings, per_replica),
                          donate_argnums=(0,)),
                  tuple(jax.jit(functools.partial(outer_step, fragment=f), in_shardings=(shardings,),
                                out_shardings=shardings, donate_argnums=(0,)) for f in range(dil.fragments)),
                  jax.jit(diloco.mean_metrics, out_shardings=NamedSharding(mesh, P())), dil)


def start(dil: diloco.Diloco, inner_tx: optax.GradientTransformation, comm) -> Callable:
    """params -> TrainState.comm: the round every replica starts from the outer params, the
    outer momentum at zero (jitted into `comm`'s shardings: its ShapeDtypeStructs)."""
    return jax.jit(lambda params: diloco.start_round(dil, inner_tx, params, comm.get("momentum", ())),
                   out_shardings=jax.tree.map(lambda s: s.sharding, comm))
