"""Train state: abstract shapes -> logical axes -> shardings -> sharded init.

Nothing here materialises the full model on the host: the model is built
abstractly with `nnx.eval_shape`, the layout turns each parameter's logical axes
into a NamedSharding, and `jax.jit(init, out_shardings=...)` creates every array
directly in its shards.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from meshtrain.errors import UserError
from meshtrain.models import Family, ModelConfig, family_of
from meshtrain.parallel.layouts import Layout
from meshtrain.parallel.layouts.rules import mesh_axes_of
from meshtrain.parallel.pipeline.scan import Pipeline, stage_axes, stage_shape, to_stages
from meshtrain.tree_paths import path_str

# Where a logical dim's size comes from, for error messages (a family adds its own).
SIZE_KEYS = {
    "batch": "train.batch_size / train.grad_accum_steps", "length": "model.seq_len",
    "vocab": "the padded vocabulary", "layers": "model.num_layers", "stage": "the stage count",
}


@flax.struct.dataclass
class TrainState:
    step: jax.Array   # [] int32
    rng: jax.Array    # [2] uint32: key data of the run's base PRNG key (dropout folds in the step)
    params: Any       # nested dict of arrays, as nnx.State.to_pure_dict()
    opt_state: Any    # optax state over params
    # The model's non-trainable state (nnx.BatchStat: BatchNorm's running statistics), a
    # nested dict of arrays that the training forward pass updates; {} for most models.
    stats: Any = flax.struct.field(default_factory=dict)
    # What the gradients' reduction carries from step to step: train.grad_compression's
    # error feedback buffers (parallel/compression.py); {} for most runs.
    comm: Any = flax.struct.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class ModelDef:
    """What the step needs to rebuild the model from a params dict inside jit."""

    cfg: ModelConfig
    family: Family
    graphdef: Any
    shapes: Any   # params dict of ShapeDtypeStruct
    axes: Any     # params dict of logical-axis tuples
    # When set, params[family.stacked] are stored [stage, layers per stage, ...] (pipeline.to_stages).
    pipeline: Pipeline | None = None
    stats_shapes: Any = dataclasses.field(default_factory=dict)  # nnx.BatchStat dict of ShapeDtypeStruct
    stats_axes: Any = dataclasses.field(default_factory=dict)    # ... and of logical-axis tuples

    @property
    def stacked(self) -> str:
        """The params key of the stacked layers (what the pipeline cuts into stages)."""
        return self.family.stacked

    @property
    def task(self) -> str:
        return self.family.task

    def bind(self, params, stats=None) -> nnx.Module:
        """The module with `params` and `stats` (its BatchStat state; may be left out only
        by a model without one)."""
        if stats is None:
            if self.stats_shapes:
                raise ValueError("this model has BatchStat state: bind(params, stats)")
            stats = {}
        return nnx.merge(self.graphdef, params, stats)

    def stats_of(self, module: nnx.Module):
        """The BatchStat state of a bound module, as a nested dict (after a forward pass)."""
        return nnx.to_pure_dict(nnx.state(module, nnx.BatchStat))

    def init_params(self, seed: int):
        """The model's initial params; the same values under any pipeline, only reordered."""
        return self.init_variables(seed)[0]

    def init_variables(self, seed: int):
        """(params, stats) of a freshly initialised model."""
        _, params, stats = nnx.split(self.family.module(self.cfg, nnx.Rngs(seed)), nnx.Param, nnx.BatchStat)
        params = nnx.to_pure_dict(params)
        if self.pipeline is not None:
            params[self.stacked] = to_stages(params[self.stacked], self.pipeline)
        return params, nnx.to_pure_dict(stats)

    def activation_axes(self) -> list[tuple[str, tuple]]:
        """[(what, logical axes)] of the activations the forward pass constrains."""
        return [(what, axes) for what, _, axes in self.family.activations(self.cfg, 1)]

    def size_keys(self) -> dict[str, str]:
        return {**SIZE_KEYS, **self.family.size_keys}


def abstract_model(cfg: ModelConfig, pipeline: Pipeline | None = None) -> ModelDef:
    fam = family_of(cfg)
    model = nnx.eval_shape(lambda: fam.module(cfg, nnx.Rngs(0)))
    graphdef, state, stats = nnx.split(model, nnx.Param, nnx.BatchStat)
    axes, shapes = _axes_of(state), nnx.to_pure_dict(state)
    if pipeline is not None:
        check_pipelinable(fam)
        is_axes = lambda x: isinstance(x, tuple)  # noqa: E731
        axes[fam.stacked] = jax.tree.map(stage_axes, axes[fam.stacked], is_leaf=is_axes)
        shapes[fam.stacked] = jax.tree.map(lambda a: stage_shape(a, pipeline), shapes[fam.stacked])
    return ModelDef(cfg, fam, graphdef, shapes, axes, pipeline, nnx.to_pure_dict(stats), _axes_of(stats))


def check_pipelinable(fam: Family) -> None:
    """A pipeline cuts the family's stack of identical layers into stages; refuse one without."""
    if fam.stacked is not None and not fam.pipelines:
        raise UserError(
            f"model.name={fam.name!r} cannot be pipelined yet: its layers pass router statistics "
            f"along with the residual stream, which the pipeline schedules do not carry. Use a "
            f"layout without a stage axis (e.g. dp_ep, fsdp_ep, dp_ep_tp) and pipeline.microbatches=0.")
    if fam.stacked is None:
        raise UserError(
            f"model.name={fam.name!r} cannot be pipelined: a pipeline stage is one program "
            f"over a slice of a stack of identical layers, and {fam.name} has no such stack "
            f"(its layers differ in shape from one to the next). Use a layout without a "
            f"stage axis (dp, zero1, fsdp, dp_tp, dp_spatial) and pipeline.microbatches=0.")


def _axes_of(state) -> dict:
    """A nested dict of each variable's logical axes (its `out_sharding` metadata)."""
    axes: dict = {}
    for path, var in nnx.to_flat_state(state):
        node = axes
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = tuple(var.get_metadata()["out_sharding"])
    return axes


def check_divisible(shape, axes, spec: P, mesh: Mesh, layout: Layout, where: str,
                    size_keys: dict[str, str] = SIZE_KEYS) -> None:
    """Every sharded dim must split evenly over its mesh axes; else say which and why."""
    for size, name, entry in zip(shape, axes, tuple(spec) + (None,) * len(shape)):
        mesh_axes = mesh_axes_of(entry)
        if not mesh_axes:
            continue
        parts = math.prod(mesh.shape[a] for a in mesh_axes)
        if size % parts:
            over = " x ".join(f"{a}={mesh.shape[a]}" for a in mesh_axes)
            raise UserError(
                f"{size_keys.get(name, name)} = {size} is not divisible by {parts}: layout "
                f"{layout.name!r} splits {name!r} over mesh axes {over} (first seen on {where}, "
                f"shape {tuple(shape)}). Use a mesh whose {'+'.join(mesh_axes)} size divides "
                f"{size}, change the model size, or use a layout that does not split {name!r}.")


def param_shardings(model: ModelDef, layout: Layout, mesh: Mesh, target: str):
    """params dict of NamedSharding under `layout.<target>` rules; checks divisibility."""
    return _shardings(model, model.shapes, model.axes, layout, mesh, target, "parameter")


def stats_shardings(model: ModelDef, layout: Layout, mesh: Mesh):
    """stats dict of NamedSharding: BatchStat variables are stored like parameters."""
    return _shardings(model, model.stats_shapes, model.stats_axes, layout, mesh, "params", "statistic")


def _shardings(model: ModelDef, shapes, axes_tree, layout: Layout, mesh: Mesh, target: str, what: str):
    def one(path, shape, axes):
        where = f"{what} {path_str(path)}"
        spec = layout.spec(axes, target, where=where)
        check_divisible(shape.shape, axes, spec, mesh, layout, where, model.size_keys())
        return NamedSharding(mesh, spec)
    return jax.tree_util.tree_map_with_path(one, shapes, axes_tree)


def check_activations(model: ModelDef, micro_batch: int, layout: Layout, mesh: Mesh) -> None:
    """Divisibility of the activations the model constrains, before any tracing."""
    for what, shape, axes in model.family.activations(model.cfg, micro_batch):
        spec = layout.spec(axes, "activations", where=f"activation {what}")
        check_divisible(shape, axes, spec, mesh, layout, f"activation {what} {axes}", model.size_keys())


def state_shardings(model: ModelDef, tx: optax.GradientTransformation, params, moments,
                    mesh: Mesh, stats=None, comm=None) -> TrainState:
    """TrainState of NamedShardings from params-shaped shardings of the params and of the
    optimizer moments (`param_shardings` under the params and opt_state rules), the
    stats' (`stats_shardings`; default: none, for a model without) and the reduction's
    state's (`comm`: ShapeDtypeStructs, compression.state_shapes; default: none)."""
    abstract_opt = jax.eval_shape(tx.init, model.shapes)
    replicated = NamedSharding(mesh, P())
    opt = optax.tree_map_params(
        tx, lambda _, s: s, abstract_opt, moments,
        transform_non_params=lambda _: replicated, is_leaf=lambda x: isinstance(x, NamedSharding))
    return TrainState(step=replicated, rng=replicated, params=params, opt_state=opt,
                      stats={} if stats is None else stats,
                      comm={} if comm is None else jax.tree.map(lambda s: s.sharding, comm))


def base_key_data(seed) -> jax.Array:
    """[2] uint32: raw data of the run's PRNG key, kept in the state so a checkpoint carries it."""
    return jax.random.key_data(jax.random.key(seed))


def init_state(model: ModelDef, tx: optax.GradientTransformation, shardings: TrainState,
               seed: int, compiler_options: dict | None = None, comm=None) -> TrainState:
    """Creates the state directly in its shards (no host copy of the full model), its one
    program compiled with `compiler_options` (XLA's, as jax.jit takes them); `comm`: the
    reduction state's ShapeDtypeStructs (zeros to start)."""
    def init():
        params, stats = model.init_variables(seed)
        return TrainState(step=jnp.zeros((), jnp.int32), rng=base_key_data(seed), params=params,
                          opt_state=tx.init(params), stats=stats, comm=zeros(comm))
    return jax.jit(init, out_shardings=shardings, compiler_options=compiler_options)()


def zeros(shapes) -> Any:
    """Zeros shaped like a pytree of ShapeDtypeStructs (None: {})."""
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes or {})


def abstract_state(model: ModelDef, tx: optax.GradientTransformation, shardings: TrainState,
                   comm=None) -> TrainState:
    """ShapeDtypeStructs with shardings, for compiling without allocating."""
    shapes = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), rng=jax.eval_shape(base_key_data, 0),
                        params=model.shapes, opt_state=jax.eval_shape(tx.init, model.shapes),
                        stats=model.stats_shapes, comm=comm or {})
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, shardings)
