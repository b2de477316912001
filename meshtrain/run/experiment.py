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
import ml_collections
import optax
from jax.sharding import Mesh

from meshtrain import mesh as mesh_lib, models
from meshtrain.checkpoints import init_from, reading, store as checkpoint_store
from meshtrain.cluster import distributed
from meshtrain.data import make_source
from meshtrain.errors import UserError
from meshtrain.models import documents
from meshtrain.parallel import layouts
from meshtrain.parallel import sequence
from meshtrain.parallel import diloco as diloco_lib, grad_reduce, momentum_compression, offload as offload_lib
from meshtrain.parallel.layouts import Layout
from meshtrain.parallel.pipeline import scan as pipeline
from meshtrain.run import loop
from meshtrain.run.compile_options import analysis_options, QUICK_INIT_PARAMS
from meshtrain.runlog import trackers
from meshtrain.step import tasks
from meshtrain.step import loss as loss_lib, optim, programs, rounds, state as state_lib, train_step as step_lib


def vocab_shards(layout: Layout, mesh: Mesh) -> int:
    """lcm over the rule tables: the table must split evenly wherever it is sharded."""
    return math.lcm(*(layout.shards("vocab", mesh.shape, t)[0] for t in layouts.rules.TARGETS))


def check_batch(cfg: ml_collections.ConfigDict, layout: Layout, mesh: Mesh,
                pipe: pipeline.Pipeline | None = None) -> int:
    """Returns the microbatch size after checking batch divisibility with the arithmetic."""
    t = cfg.train
    k = t.grad_accum_steps
    if t.batch_size < 1 or k < 1:
        raise UserError(f"train.batch_size={t.batch_size} and train.grad_accum_steps={k} must be >= 1.")
    shards, over = layout.shards("batch", mesh.shape)
    if t.batch_size % (k * shards):
        raise UserError(
            f"train.batch_size={t.batch_size} must be divisible by train.grad_accum_steps x batch shards "
            f"= {k} x {shards} = {k * shards} (layout {layout.name!r} splits batch over "
            f"{'+'.join(over) or 'no axis'}). Use a batch size that is a multiple of {k * shards}.")
    if pipe is not None:
        m = pipe.microbatches
        inner, over = layout.without("stage").shards("batch", mesh.shape)
        if t.batch_size % (k * m * inner):
            raise UserError(
                f"train.batch_size={t.batch_size} must be divisible by train.grad_accum_steps x "
                f"pipeline.microbatches x batch shards in a stage = {k} x {m} x {inner} = "
                f"{k * m * inner} (inside the pipeline, layout {layout.name!r} splits batch over "
                f"{'+'.join(over) or 'no axis'}). Use a batch size that is a multiple of "
                f"{math.lcm(k * m * inner, k * shards)}, or fewer pipeline microbatches.")
    return t.batch_size // k


@dataclasses.dataclass(frozen=True)
class Inputs:
    """What a config names on disk, read once per run: the checkpoint `init.from` starts
    from and the data source (a text corpus is tokenized here). A planner search builds
    every candidate from one."""

    init: init_from.InitSource | None
    source: Any


def read_inputs(cfg: ml_collections.ConfigDict) -> Inputs:
    """Reads init.from's checkpoint description and builds the data source."""
    init = init_from.read(cfg.init["from"]) if cfg.init["from"] else None
    cfg = resolve(cfg, init)
    dims = init_from.model_dims(init, cfg.model) if init else models.size_dims(cfg.model)
    # The task decides what the data must produce: token windows of seq_len + 1, or images.
    task = tasks.kind(models.family.get(cfg.model.name).task)
    source = make_source(cfg.data, vocab_size=dims["vocab_size"], seed=cfg.train.seed, **task.source_args(dims))
    return Inputs(init, source)


def resolve(cfg: ml_collections.ConfigDict, init: init_from.InitSource | None) -> ml_collections.ConfigDict:
    """The config a run uses and prints: `cfg` itself, or with init.from a copy whose
    model.* and data.tokenizer follow the checkpoint (init_from.resolve)."""
    return cfg if init is None else init_from.resolve(cfg, init)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a config resolves to on a mesh, before anything is traced."""

    layout: Layout
    model: state_lib.ModelDef
    params: Any     # params-shaped NamedShardings: how weights are stored
    opt_state: Any  # params-shaped NamedShardings: optimizer moments, and where gradients reduce to
    stats: Any      # stats-shaped NamedShardings: BatchStat state ({} for most models)


def validate(cfg: ml_collections.ConfigDict, mesh, inputs: Inputs) -> Plan:
    """Every check that needs no devices, each section by the module that owns its keys:
    layout and batch here, pipeline.*, train.* (loop; the task's: loss_chunk for a language model; trackers: trackers),
    checkpoint.*, data.*, optim.*, model.*. It only reads: `cfg` is resolved already
    (`resolve`), and what it names on disk was read once (`inputs`).

    `mesh` may be a jax.sharding.AbstractMesh, so a 32-device config can be checked
    on a laptop without simulating its devices.
    """
    layout = layouts.get(cfg.layout)
    src, source = inputs.init, inputs.source
    dims = init_from.model_dims(src, cfg.model) if src else models.size_dims(cfg.model)
    fam = models.family.get(cfg.model.name)
    if cfg.pipeline.microbatches > 0 or (mesh.shape["stage"] > 1 and pipeline.uses_stage(layout)):
        state_lib.check_pipelinable(fam)
    pipe = pipeline.from_config(cfg.pipeline, mesh.shape["stage"], dims["num_layers"], layout)
    pipeline.check_layout(layout, pipe)
    micro = check_batch(cfg, layout, mesh, pipe)
    loop.check_config(cfg.train)
    tasks.kind(fam.task).check_config(cfg.train, dims)
    grad_reduce.check(cfg.train)
    momentum_compression.check(cfg.train, cfg.optim)
    diloco_lib.check(cfg.diloco)
    grad_reduce.check_layout(cfg.train, layout)
    offload_lib.check_config(cfg.train)
    offload_lib.check_model(offload_lib.Offload.of(cfg.train), fam.name, fam.stacked, cfg.train.accum_gather,
                            pipelined=pipe is not None)
    checkpoint_store.check_config(cfg.checkpoint)
    trackers.check_config(cfg.train)
    documents.check_packing(cfg.data.packing, source.info, fam.task)
    vocab = (init_from.vocab_size(src, source.vocab_size) if src
             else _model_vocab(cfg.model, source, cfg.data.kind))
    model_cfg = models.model_config(cfg.model, vocab_size=vocab, vocab_shards=vocab_shards(layout, mesh),
                                    dims=dims, sections=cfg)
    if model_cfg.seq_len:  # a split sequence: 2 chunks per device, whole chunks per loss chunk
        sequence.check(layout, mesh.shape, model_cfg.seq_len)
        loss_lib.check_split(cfg.train.loss_chunk, model_cfg.seq_len, layout, mesh.shape)
    model = state_lib.abstract_model(model_cfg, pipe)
    grad_reduce.check_stats(cfg.train, bool(model.stats_shapes), model.family.name)
    state_lib.check_activations(model, micro, layout, mesh)
    if pipe is not None:
        state_lib.check_activations(model, micro // pipe.microbatches, layout.without("stage"), mesh)
    optim.schedule(cfg.optim, max(cfg.train.steps, 1), cfg.train.batch_size)
    # Raise on indivisible dims, naming the parameter; kept, so they are resolved once.
    params, opt_state = (state_lib.param_shardings(model, layout, mesh, t) for t in ("params", "opt_state"))
    if layout.splits_grads:  # divisibility of the gradients' split (ZeRO-2)
        state_lib.param_shardings(model, layout, mesh, "grads")
    return Plan(layout, model, params, opt_state, state_lib.stats_shardings(model, layout, mesh))


def check_config(cfg: ml_collections.ConfigDict, mesh) -> Plan:
    """Everything a config can get wrong, without devices: read_inputs, resolve, validate
    (what `meshtrain train` checks before tracing; tests and notebooks call this)."""
    inputs = read_inputs(cfg)
    return validate(resolve(cfg, inputs.init), mesh, inputs)


def _model_vocab(m: ml_collections.ConfigDict, source, kind: str) -> int:
    """The model's vocabulary: model.vocab_size when set (at least the data's), else the data's."""
    if m.vocab_size is not None and m.vocab_size < source.vocab_size:
        raise UserError(
            f"model.vocab_size={m.vocab_size} is smaller than the data's vocabulary ({source.vocab_size} "
            f"tokens from {kind!r}). Leave model.vocab_size unset to follow the data.")
    return m.vocab_size or source.vocab_size


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
    batch_sharding: Any  # a NamedSharding per batch field, like task.batch_fields
    task: tasks.Task
    dcn: dict[str, int] | None = None  # the inter-node factor of each axis (mesh.parse_dcn)
    init: init_from.InitSource | None = None  # init.from: the checkpoint the run starts from
    # How train_step gathers fsdp-sharded params with microbatches, "once" or "each" per
    # step, and why: train.accum_gather, with "auto" decided before the step is built (build).
    accum_gather: str = "each"
    accum_why: str = ""
    offload: offload_lib.Offload = offload_lib.Offload()  # what train.offload keeps in host memory
    reduction: grad_reduce.Reduction = grad_reduce.Reduction()  # how the replicas' gradients are reduced
    # diloco.*: the islands, and the inner optimizer (optim.*'s; `tx` is then the outer one)
    diloco: diloco_lib.Diloco | None = None
    inner_tx: optax.GradientTransformation | None = None

    @classmethod
    def build(cls, cfg: ml_collections.ConfigDict, devices: Sequence[jax.Device] | None = None,
              mesh_shape: dict | None = None, inputs: Inputs | None = None,
              choose_gather: Callable | None = None) -> "Experiment":
        """Validates `cfg` and builds everything short of tracing. `cfg` is not changed:
        the experiment keeps its resolved copy (`exp.cfg`, what run.json records).

        `devices` defaults to all devices; `mesh_shape` overrides cfg.mesh.shape
        (tests use a 1-device mesh as the reference); `inputs` (read_inputs(cfg)) is read
        here when not given. `choose_gather(cfg, mesh, plan) -> (mode, why)` decides
        train.accum_gather from shapes, before the step is built (the train and plan
        commands pass planner/accumulation.py's `choose`, which decides "auto" by the memory
        formulas); without it "auto" builds "each".
        """
        inputs = read_inputs(cfg) if inputs is None else inputs
        cfg = resolve(cfg, inputs.init)
        devices = list(devices if devices is not None else jax.devices())
        shape = mesh_lib.parse_shape(mesh_shape if mesh_shape is not None else cfg.mesh.shape)
        shape = mesh_lib.resolve_shape(shape, len(devices))
        dcn = mesh_lib.parse_dcn(cfg.mesh.dcn, shape) if mesh_shape is None else None
        mesh = mesh_lib.make_mesh(shape, devices, dcn=dcn, hosts=distributed.hosts())
        plan = validate(cfg, mesh, inputs)
        offload = offload_lib.Offload.of(cfg.train)
        offload_lib.check_devices(offload, cfg.model.remat, devices)
        layout, model, source, t = plan.layout, plan.model, inputs.source, cfg.train

        total = max(t.steps, 1)
        schedule = optim.schedule(cfg.optim, total, t.batch_size)
        tx = optim.make(cfg.optim, schedule, model.axes, momentum_compression.frozen_variance_at(t))
        # Gradients are reduced to where the moments live (reduce-scatter under FSDP/ZeRO-1).
        grad_shardings = plan.opt_state
        task = tasks.for_family(model.task, source.info, cfg.data)
        batch_sharding = step_lib.batch_sharding(layout, mesh, task.batch_fields(model.cfg, 1))
        accum, why = (choose_gather(cfg, mesh, plan) if choose_gather is not None else
                      ("each" if t.accum_gather == "auto" else t.accum_gather, f"train.accum_gather={t.accum_gather}"))
        if offload.params and accum == "once":  # "auto"'s pick; an explicit "once" was refused
            accum, why = "each", "train.offload=params brings one layer to the device at a time"
        reduction = momentum_compression.with_momentum(grad_reduce.of_run(
            t, accum, layout, mesh, dcn, model.shapes, plan.params, step_lib.replica_dtypes(model, t.grad_accum_steps),
            bool(cfg.diloco.every)), t, cfg.optim, layout, bool(cfg.diloco.every))
        dil = diloco_lib.resolve(cfg.diloco, t, layout, dict(mesh.shape), dcn,
                                 grad_reduce.replica_axes(layout, mesh, plan.params), grad_shardings,
                                 bool(model.stats_shapes), model.pipeline is not None,
                                 diloco_lib.stack_of(model.stacked, model.shapes, plan.params))
        inner_tx, tx = (tx, optax.identity()) if dil else (None, tx)  # DiLoCo's outer state is in comm
        comm = grad_reduce.state_shapes(reduction, dil, inner_tx, model.shapes, plan.params, grad_shardings, mesh,
                                        model.stacked)
        shardings = offload.state_shardings(
            state_lib.state_shardings(model, tx, plan.params, grad_shardings, mesh, plan.stats, comm))
        same = dict(grad_accum_steps=t.grad_accum_steps, nonfinite=t.nonfinite, loss_chunk=t.loss_chunk, task=task,
                    batch_shardings=batch_sharding)
        train_step = (rounds.make_rounds(model, inner_tx, schedule, layout, mesh, shardings, plan.params, dil,
                                         **same) if dil else step_lib.make_train_step(model, tx, schedule, layout, mesh, shardings, grad_shardings,
                                                           reduction=reduction, offload=offload, **same))
        eval_step = step_lib.make_eval_step(model, layout, mesh, shardings.params, t.loss_chunk,
                                            task, shardings.stats, batch_sharding, offload)
        return cls(cfg, mesh, layout, model, tx, schedule, shardings, grad_shardings, source,
                   train_step, eval_step, batch_sharding, task, dcn, inputs.init, accum, why, offload, reduction,
                   dil, inner_tx)

    def gradients_line(self) -> str | None:
        """The start-up line on how the replicas' gradients meet (grad_reduce.describe), or
        None where no key changed it."""
        _, replicas = self.reduction.axes(self.layout, self.mesh, self.shardings.params,
                                          self.cfg.train.grad_accum_steps, bool(self.model.stats_shapes))
        local = 0 if self.diloco is None else diloco_lib.local_values(self.model.shapes, self.shardings.params,
                                                                        self.mesh)
        return grad_reduce.describe(self.reduction, replicas, dict(self.mesh.shape), self.diloco, local)

    @property
    def batch_fields(self):
        """The task's batch at train.batch_size rows: a pytree of tasks.Field."""
        return self.task.batch_fields(self.model.cfg, self.cfg.train.batch_size)

    @property
    def batch_shape(self):
        """The global shape of each batch field (token rows: (B, T+1))."""
        return jax.tree.map(lambda f: f.shape, self.batch_fields, is_leaf=tasks.task.is_field)

    @property
    def units_per_step(self) -> int:
        """Throughput units (task.unit: tokens, images) in one step's batch."""
        return self.cfg.train.batch_size * self.task.units_per_example(self.model.cfg)

    def init_state(self) -> state_lib.TrainState:
        """Step 0: fresh params, or init.from's params; a fresh optimizer either way."""
        if self.init is not None:
            return reading.init_state(self.init, self)
        state = state_lib.init_state(self.model, self.tx, self.shardings.replace(comm={}), self.cfg.train.seed,
                                     analysis_options() if self._quick_init() else None)
        return state.replace(comm=self.fresh_comm(state.params))

    def fresh_comm(self, params):
        """TrainState.comm as a run starts it from `params`: the feedback buffers' zeros, or
        DiLoCo's round from the outer params."""
        if self.diloco is None:
            return jax.jit(lambda: state_lib.zeros(self.comm), out_shardings=self.shardings.comm)()
        return rounds.start(self.diloco, self.inner_tx, self.comm)(params)

    def _quick_init(self) -> bool:
        """Whether the init compiles with the analysis options: on CPU, for a model of at
        most QUICK_INIT_PARAMS parameters."""
        return self.on_cpu and self.num_params() <= QUICK_INIT_PARAMS

    @property
    def comm(self) -> dict:
        """TrainState.comm's ShapeDtypeStructs: the reduction's feedback buffers, DiLoCo's
        round, or {}."""
        return grad_reduce.state_shapes(self.reduction, self.diloco, self.inner_tx, self.model.shapes,
                                        self.shardings.params, self.grad_shardings, self.mesh, self.model.stacked)

    @property
    def on_cpu(self) -> bool:
        """Whether the mesh is CPU devices (real or simulated)."""
        return self.mesh.devices.flat[0].platform == "cpu"

    def abstract_state(self) -> state_lib.TrainState:
        return state_lib.abstract_state(self.model, self.tx, self.shardings, self.comm)

    def compile(self, analysis: bool = False):
        """AOT-compiles the train step from shapes alone (nothing allocated). `analysis`:
        a step only read (its HLO, buffers, collectives, FLOPs) or run SHORT_RUN_STEPS
        times at most: on CPU it compiles with analysis_options(), 2-4x faster."""
        options = analysis_options() if analysis and self.on_cpu else None
        if isinstance(self.train_step, programs.Programs):
            return self.train_step.compile(self.abstract_state(), self.abstract_batch(), options)
        return self.train_step.lower(self.abstract_state(), self.abstract_batch()).compile(options)

    def abstract_batch(self):
        """The batch as ShapeDtypeStructs with their shardings, for compiling."""
        return jax.tree.map(lambda f, sh: f.struct(sh), self.batch_fields, self.batch_sharding,
                            is_leaf=tasks.task.is_field)

    def put_batch(self, local_rows):
        """This process's rows of each batch field ([B / processes, T+1] token rows, or the
        task's dict) -> global sharded arrays ([B, T+1], ...)."""
        return jax.tree.map(lambda sh, x, shape: jax.make_array_from_process_local_data(sh, x, shape),
                            self.batch_sharding, local_rows, self.batch_shape)

    def train_batches(self, start_step: int = 0):
        d = self.cfg.data
        return self.source.train_batches(self.cfg.train.batch_size, process_index=jax.process_index(),
                                         process_count=jax.process_count(), start_step=start_step,
                                         workers=d.workers, prefetch=d.prefetch)

    def eval_batches(self, num_batches: int | None = None):
        """This process's rows [B / processes, T+1] of held-out batches 0 .. num_batches - 1
        (default train.eval_steps), the same every call."""
        n = self.cfg.train.eval_steps if num_batches is None else num_batches
        return self.source.eval_batches(self.cfg.train.batch_size, n,
                                        process_index=jax.process_index(),
                                        process_count=jax.process_count())

    def num_params(self) -> int:
        """Parameters of the model as defined (unpadded vocabulary): the closed form."""
        return self.model.family.num_params(self.model.cfg)

    def num_stored_params(self) -> int:
        return sum(math.prod(s.shape) for s in jax.tree.leaves(self.model.shapes))
