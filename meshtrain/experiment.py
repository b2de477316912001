"""Config -> mesh, layout, model, optimizer, shardings and jitted steps, in one object.

The CLI, the tests, the notebooks and the benchmarks all build runs through
`Experiment.build(cfg)`, so they exercise the same code:

    exp = Experiment.build(cfg)              # validates, nothing traced yet
    compiled = exp.compile()                 # AOT compile of the train step
    state = exp.init_state()                 # sharded init
    state, metrics = exp.train_step(state, exp.put_batch(batch))
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding

from meshtrain import distributed, layouts, mesh as mesh_lib, models, optim, pipeline, state as state_lib, step as step_lib
from meshtrain.data import make_source
from meshtrain.errors import UserError
from meshtrain.layouts import Layout
from meshtrain.layouts.rules import mesh_axes_of


def _shards(layout: Layout, mesh: Mesh, name: str, target: str) -> tuple[int, tuple[str, ...]]:
    """How many pieces a lone logical dim `name` is split into under `target`, and over what."""
    axes = mesh_axes_of(layout.spec((name,), target)[0])
    return math.prod(mesh.shape[a] for a in axes), axes


def _vocab_shards(layout: Layout, mesh: Mesh) -> int:
    """lcm over the rule tables: the table must split evenly wherever it is sharded."""
    return math.lcm(*(_shards(layout, mesh, "vocab", t)[0] for t in layouts.rules.TARGETS))


def check_batch(cfg: ml_collections.ConfigDict, layout: Layout, mesh: Mesh,
                pipe: pipeline.Pipeline | None = None) -> int:
    """Returns the microbatch size after checking batch divisibility with the arithmetic."""
    t = cfg.train
    k = t.microbatches
    if t.batch_size < 1 or k < 1:
        raise UserError(f"train.batch_size={t.batch_size} and train.microbatches={k} must be >= 1.")
    shards, over = _shards(layout, mesh, "batch", "activations")
    if t.batch_size % (k * shards):
        raise UserError(
            f"train.batch_size={t.batch_size} must be divisible by train.microbatches x batch shards "
            f"= {k} x {shards} = {k * shards} (layout {layout.name!r} splits batch over "
            f"{'+'.join(over) or 'no axis'}). Use a batch size that is a multiple of {k * shards}.")
    if pipe is not None:
        m = pipe.microbatches
        inner, over = _shards(layout.without("stage"), mesh, "batch", "activations")
        if t.batch_size % (k * m * inner):
            raise UserError(
                f"train.batch_size={t.batch_size} must be divisible by train.microbatches x "
                f"pipeline.microbatches x batch shards in a stage = {k} x {m} x {inner} = "
                f"{k * m * inner} (inside the pipeline, layout {layout.name!r} splits batch over "
                f"{'+'.join(over) or 'no axis'}). Use a batch size that is a multiple of "
                f"{math.lcm(k * m * inner, k * shards)}, or fewer pipeline microbatches.")
    return t.batch_size // k


def check_stage_rules(layout: Layout, pipe: pipeline.Pipeline | None) -> None:
    """A pipelined run needs the params' `stage` dim on the `stage` mesh axis in every table."""
    if pipe is None:
        return
    for target in layouts.rules.TARGETS:
        if mesh_axes_of(layout.spec(("stage",), target)[0]) != ("stage",):
            raise UserError(
                f"Layout {layout.name!r} does not put the logical axis 'stage' on the mesh axis "
                f"'stage' in its {target} rules, but the run is pipelined (pipeline.microbatches="
                f"{pipe.microbatches}). Use a pipeline layout ({', '.join(layouts.PIPELINE_PRESETS)}) "
                f"or begin every table with 'stage:stage'.")


def validate(cfg: ml_collections.ConfigDict, mesh) -> tuple[Layout, state_lib.ModelDef, Any]:
    """Every check that needs no devices: layout, batch, model dims, divisibility, data.

    `mesh` may be a jax.sharding.AbstractMesh, so a 32-device config can be checked
    on a laptop without simulating its devices.
    """
    layout = layouts.get(cfg.layout)
    m = cfg.model
    dims = models.size_dims(m)
    pipe = pipeline.from_config(cfg.pipeline, mesh.shape["stage"], dims["num_layers"])
    check_stage_rules(layout, pipe)
    micro = check_batch(cfg, layout, mesh, pipe)
    t = cfg.train
    if t.steps < 0:
        raise UserError(f"train.steps={t.steps}: must be >= 0 (0 compiles and exits).")
    if t.log_every < 1 or t.eval_every < 0 or (t.eval_every and t.eval_steps < 1):
        raise UserError(
            f"train.log_every={t.log_every}, train.eval_every={t.eval_every}, train.eval_steps="
            f"{t.eval_steps}: log_every must be >= 1, eval_every >= 0 (0 turns eval off), and "
            f"eval_steps >= 1 when eval is on.")
    if t.nonfinite not in step_lib.NONFINITE_POLICIES or t.max_skips < 1:
        raise UserError(
            f"train.nonfinite={t.nonfinite!r}, train.max_skips={t.max_skips}: nonfinite must be one "
            f"of {', '.join(step_lib.NONFINITE_POLICIES)} and max_skips >= 1.")
    if not 0 <= t.stop_at <= t.steps:
        raise UserError(f"train.stop_at={t.stop_at}: must be between 0 (off) and train.steps={t.steps}.")
    c = cfg.checkpoint
    if c.every < 0 or c.keep < 0:
        raise UserError(f"checkpoint.every={c.every}, checkpoint.keep={c.keep}: both must be >= 0 "
                        f"(every=0 saves only at the end, at train.stop_at and on SIGTERM; keep=0 "
                        f"keeps every checkpoint).")
    d = cfg.data
    if d.workers < 0 or d.prefetch < 0:
        raise UserError(
            f"data.workers={d.workers}, data.prefetch={d.prefetch}: both must be >= 0 (workers "
            f"is grain worker processes, 0 reads in this process; prefetch is batches read "
            f"ahead, 0 reads on demand).")
    source = make_source(cfg.data, vocab_size=dims["vocab_size"], seq_len=dims["seq_len"],
                         seed=cfg.train.seed)
    vocab = source.vocab_size
    if m.vocab_size is not None and m.vocab_size < vocab:
        raise UserError(
            f"model.vocab_size={m.vocab_size} is smaller than the data's vocabulary ({vocab} "
            f"tokens from {cfg.data.kind!r}). Leave model.vocab_size unset to follow the data.")
    vocab = m.vocab_size or vocab
    model_cfg = models.model_config(m, vocab_size=vocab, vocab_shards=_vocab_shards(layout, mesh))
    model = state_lib.abstract_model(model_cfg, pipe)
    state_lib.check_activations(model, micro, layout, mesh)
    if pipe is not None:
        state_lib.check_activations(model, micro // pipe.microbatches, layout.without("stage"), mesh)
    for target in ("params", "opt_state"):
        state_lib.param_shardings(model, layout, mesh, target)  # raises on indivisible dims
    optim.schedule(cfg.optim, max(cfg.train.steps, 1))
    return layout, model, source


def abstract_mesh(shape: dict[str, int]) -> jax.sharding.AbstractMesh:
    return jax.sharding.AbstractMesh(tuple(shape[a] for a in mesh_lib.AXES), mesh_lib.AXES)


@dataclasses.dataclass
class Experiment:
    cfg: ml_collections.ConfigDict
    mesh: Mesh
    layout: Layout
    model: state_lib.ModelDef
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    shardings: state_lib.TrainState
    grad_shardings: Any
    source: Any
    train_step: Callable
    eval_step: Callable
    batch_sharding: NamedSharding
    dcn: dict[str, int] | None = None  # the inter-node factor of each axis (mesh.parse_dcn)

    @classmethod
    def build(cls, cfg: ml_collections.ConfigDict, devices: Sequence[jax.Device] | None = None,
              mesh_shape: dict | None = None) -> "Experiment":
        """Validates `cfg` and builds everything short of tracing.

        `devices` defaults to all devices; `mesh_shape` overrides cfg.mesh.shape
        (tests use a 1-device mesh as the reference).
        """
        devices = list(devices if devices is not None else jax.devices())
        shape = mesh_lib.parse_shape(mesh_shape if mesh_shape is not None else cfg.mesh.shape)
        shape = mesh_lib.resolve_shape(shape, len(devices))
        dcn = mesh_lib.parse_dcn(cfg.mesh.dcn, shape) if mesh_shape is None else None
        mesh = mesh_lib.make_mesh(shape, devices, dcn=dcn, hosts=distributed.hosts())
        layout, model, source = validate(cfg, mesh)

        total = max(cfg.train.steps, 1)
        schedule = optim.schedule(cfg.optim, total)
        tx = optim.make(cfg.optim, schedule, model.axes)
        # Gradients are reduced to where the moments live (reduce-scatter under FSDP/ZeRO-1).
        grad_shardings = state_lib.param_shardings(model, layout, mesh, "opt_state")
        shardings = state_lib.state_shardings(
            model, tx, state_lib.param_shardings(model, layout, mesh, "params"), grad_shardings, mesh)
        train_step = step_lib.make_train_step(
            model, tx, schedule, layout, mesh, shardings, grad_shardings,
            microbatches=cfg.train.microbatches, nonfinite=cfg.train.nonfinite)
        eval_step = step_lib.make_eval_step(model, layout, mesh, shardings.params)
        batch_sharding = step_lib.batch_sharding(layout, mesh)
        return cls(cfg, mesh, layout, model, tx, schedule, shardings, grad_shardings, source,
                   train_step, eval_step, batch_sharding, dcn)

    @property
    def batch_shape(self) -> tuple[int, int]:
        return (self.cfg.train.batch_size, self.model.cfg.seq_len + 1)

    def init_state(self) -> state_lib.TrainState:
        return state_lib.init_state(self.model, self.tx, self.shardings, self.cfg.train.seed)

    def abstract_state(self) -> state_lib.TrainState:
        return state_lib.abstract_state(self.model, self.tx, self.shardings)

    def compile(self):
        """AOT-compiles the train step from shapes alone (nothing allocated)."""
        batch = jax.ShapeDtypeStruct(self.batch_shape, jnp.int32, sharding=self.batch_sharding)
        return self.train_step.lower(self.abstract_state(), batch).compile()

    def put_batch(self, local_rows: np.ndarray) -> jax.Array:
        """This process's rows [B / processes, T+1] -> a global sharded array [B, T+1]."""
        return jax.make_array_from_process_local_data(self.batch_sharding, local_rows, self.batch_shape)

    def train_batches(self, start_step: int = 0):
        d = self.cfg.data
        return self.source.train_batches(self.cfg.train.batch_size, process_index=jax.process_index(),
                                         process_count=jax.process_count(), start_step=start_step,
                                         workers=d.workers, prefetch=d.prefetch)

    def eval_batches(self):
        return self.source.eval_batches(self.cfg.train.batch_size, self.cfg.train.eval_steps,
                                        process_index=jax.process_index(),
                                        process_count=jax.process_count())

    def num_params(self) -> int:
        """Parameters of the model as defined (unpadded vocabulary): the closed form."""
        return self.model.family.num_params(self.model.cfg)

    def num_stored_params(self) -> int:
        return sum(math.prod(s.shape) for s in jax.tree.leaves(self.model.shapes))
