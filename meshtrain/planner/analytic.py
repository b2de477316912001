"""What a layout should cost by the formulas, from the config alone (nothing compiled).

Memory per device (bytes), for fp32 master weights:
  params       sum over leaves of size / (shards of its params spec) x param bytes
  optimizer    its moments (optim.moment_dtypes: AdamW and LAMB 2, SGD and LARS with
               momentum 1) x size / (shards of its opt_state spec) x param bytes (the
               first moment in optim.mu_dtype's bytes when set)
  gradients    size / (shards of its grads spec) x param bytes: the params' sharding (the
               backward writes them there), or split like the moments under a layout
               whose grads table reduce-scatters each layer's gradient inside the backward
               pass (ZeRO-2, layouts/rules.py); plus an fp32 accumulator at the
               optimizer's sharding when train.grad_accum_steps > 1; with
               train.accum_gather=once (`gathered`) the accumulator has the gathered
               params' sharding (fsdp struck), and the gathered params themselves (matrices
               in the compute dtype) count here too: both live through the microbatch loop
  activations  layers on the device x the family's per-layer bytes (Korthikanti et al.
               2022, at the remat policy) for the tokens one microbatch puts on a device
               (the residual stream's share divided by tensor under sequence parallelism;
               a row's T / n under context parallelism, with the other devices' keys and
               values and the context attention's score blocks: planner/context.py),
               plus one layer's full activations when a remat policy recomputes them, plus
               the logits (compute dtype) with their float32 log-softmax and gradient: of
               one chunk of train.loss_chunk positions when the loss runs in chunks
               (meshtrain/loss.py), with then the output projection's gradient summed
               over the chunks in float32; under a pipeline, what each schedule keeps
               (planner/pipeline_memory.py: gpipe and circular every microbatch, 1f1b and
               interleaved the few in flight)
On a plain data-parallel mesh these reduce to ZeRO's stage formulas (arXiv 1910.02054):
stage 0 (dp) 16 Psi, stage 1 (zero1) 8 Psi + 8 Psi / N, stage 2 (zero2) 4 Psi + 12 Psi / N,
stage 3 (fsdp) 16 Psi / N with fp32 gradients and no microbatching. (XLA may split zero1's
gradients inside the backward pass of its own accord: it propagates the optimizer's
sharding back into the layer scan when nothing pins the gradient whole; the formula
counts what the layout asks for.)

Collective lower bounds (bytes each device sends per step, ring algorithms):
  gradients    every leaf's gradient reduced once over the batch axes that do not shard it
               (a conv's leaves also over the axes that split image rows, and every leaf
               over the axes that split a sequence's positions: sums over positions, reduced
               there first, then 1/n of it over the batch axes):
               all-reduce 2 (n-1)/n x local bytes; over an axis that shards only its optimizer
               state (ZeRO-1) reduce-scatter then all-gather of the updated params, the same
               bytes, in the compute dtype (the narrowest the backward computes gradients
               in; norms kept in float32 send more, and say so), or in train.grad_dtype
               over the replica axes when it is set. ZeRO-2 sends the same bytes, but its
               reduce-scatter runs once per microbatch, and for the pipelined layers once
               per pipeline tick (r*M + S - 1 times a step): counted so.
  fsdp         weights sharded over an axis that also splits the batch: gathered for the
               forward and again for the backward pass of every microbatch, (n-1)/n x
               gathered bytes each in the compute dtype, and one reduce-scatter of the
               gradients, (n-1)/n x gathered bytes, per microbatch: ZeRO-3's 3 Psi (arXiv
               1910.02054 §7). With train.accum_gather=once: one gather per step before the
               microbatch loop and one reduce-scatter of the accumulated gradients after it.
               Under a pipeline, the tables outside it (embedding, head: split over stage)
               are gathered once per accumulation microbatch, the forward's copy serving
               the backward pass, and their gradients reduce-scattered as often.
  tensor       Megatron (arXiv 1909.08053): 2 all-reduces of [b, T, D] (T/n of a context split) per layer forward and
               2 backward per microbatch, plus, when the vocabulary is split, the embedding
               lookup forward and the output projection's input gradient backward, once per
               loss chunk (meshtrain/loss.py: n chunks send n all-reduces of [b, T/n, D]).
  stage        each microbatch crosses each stage boundary once forward and once backward,
               [b, T, D] in the compute dtype, (S-1)/S of the devices sending; r times round
               the stages under circular/interleaved: (r S - 1)/S per device.
  context      a layout that splits attention's positions: k and v round the ring
               forward and their gradients back, or all-gathered and reduce-scattered
               (planner/context.py; remat's recompute is known excess).
  experts      a layout that splits `experts`: each MoE layer's dispatch and combine
               all-to-alls, forward and backward (planner/experts.py; remat's rerun is known excess).
  halo         a layout that splits image rows: each conv's k//2 rows of its input forward
               and of its output gradient backward, each way at each split boundary
               (planner/halo.py; the weight gradient's second fetch of the input's rows is
               known excess). A classifier's channel tensor parallelism has no formula
               (`no_formula`), nor has the activation memory of a family without
               layer_activation_bytes.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from meshtrain import grad_reduce, loss as loss_lib, optim, state as state_lib, step as step_lib, tree_paths
from meshtrain.errors import UserError
from meshtrain.layouts.rules import mesh_axes_of
from meshtrain.planner import context, experts, halo, pipeline_memory

GRAD_KINDS = ("all-reduce", "reduce-scatter", "all-gather")


def _axes_of(sharding) -> tuple[str, ...]:
    return tuple(a for s in sharding.spec for a in mesh_axes_of(s))


def _size(mesh, axes) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def _shards(exp, name: str, layout=None) -> tuple[int, tuple[str, ...]]:
    """(pieces, mesh axes) a lone logical dim `name` of the activations is split into."""
    return (layout or exp.layout).shards(name, exp.mesh.shape)


def local_batch(exp) -> dict:
    """Rows and tokens one device computes at a time: {"rows": per microbatch on a device
    outside the pipeline, "stage_rows": all microbatches a stage holds, "tensor": heads split,
    "vocab": vocabulary split, "micro": microbatches a step runs through each layer}."""
    cfg, pipe = exp.cfg, exp.model.pipeline
    k = cfg.train.grad_accum_steps
    shards, _ = _shards(exp, "batch")
    inner = shards if pipe is None else _shards(exp, "batch", exp.layout.without("stage"))[0]
    return {"rows": cfg.train.batch_size // k // shards,
            "stage_rows": cfg.train.batch_size // k // inner,
            "pipeline_rows": cfg.train.batch_size // k // inner // (pipe.microbatches if pipe else 1),
            "tensor": _shards(exp, "heads")[0], "vocab": _shards(exp, "vocab")[0],
            "micro": k * (pipe.microbatches if pipe else 1)}


def attention_on(exp, hw=None) -> str:
    """The attention kernel the run would use on `hw` (a planner/hardware.py entry; None:
    the backend running now): the planner compiles on CPU, where auto is always XLA,
    but a flash kernel on the GPU keeps no [T, T] probabilities."""
    if hw is None:
        return exp.model.cfg.attention
    from meshtrain import models
    from meshtrain.models.attention import Platform
    try:
        return models.attention_choice(exp.cfg.model.attention, exp.model.cfg,
                                       Platform("gpu", hw.compute_capability, cudnn=True))[0]
    except UserError:  # an explicit kernel the GPU cannot run: train would refuse it there
        return exp.model.cfg.attention


def memory(exp, hw=None) -> dict[str, float]:
    """Per-device bytes by the formulas in the module docstring, with the attention kernel
    the run would use on `hw` (`attention_on`)."""
    m = exp.model
    pbytes = jnp.dtype(m.cfg.param_dtype).itemsize
    shapes = jax.tree.leaves(m.shapes)
    params = sum(math.prod(s.shape) / _size(exp.mesh, _axes_of(sh)) for s, sh in
                 zip(shapes, jax.tree.leaves(exp.shardings.params)))
    opt = sum(math.prod(s.shape) / _size(exp.mesh, _axes_of(sh)) for s, sh in
              zip(shapes, jax.tree.leaves(exp.grad_shardings)))
    split = sum(math.prod(s.shape) / _size(exp.mesh, _axes_of(sh)) for s, sh in
                zip(shapes, jax.tree.leaves(state_lib.param_shardings(m, exp.layout, exp.mesh, "grads"))))
    grads = split * pbytes + (opt * 4 if exp.cfg.train.grad_accum_steps > 1 else 0)
    once = gathered(exp)
    if once:  # accumulator and gathered params at the params' sharding without `once`
        inner = [math.prod(s.shape) / _size(exp.mesh, [a for a in _axes_of(sh) if a not in once])
                 for s, sh in zip(shapes, jax.tree.leaves(exp.shardings.params))]
        wbytes = [jnp.dtype(d).itemsize for d in jax.tree.leaves(step_lib.produced_dtypes(m))]
        grads += sum(n * (4 + w) for n, w in zip(inner, wbytes)) - opt * 4
    moments = sum(jnp.dtype(d).itemsize for d in optim.moment_dtypes(exp.cfg.optim, m.cfg.param_dtype))
    return {"params": params * pbytes, "optimizer": opt * moments, "gradients": grads,
            "activations": activations(exp, hw)}


def abstract_experiment(cfg, model=None, layout=None, accum_gather: str = "each", shape=None):
    """What `memory` reads of an Experiment, on an abstract mesh of `shape` (default
    cfg.mesh.shape; no devices, nothing compiled: 64 devices plan on a laptop): from `cfg`
    checked by experiment.check_config, or from a given `model` (a state.ModelDef, its
    pipeline as it is) and `layout`."""
    import types
    from meshtrain import mesh as mesh_lib
    from meshtrain.experiment import abstract_mesh, check_config
    mesh = abstract_mesh(mesh_lib.parse_shape(shape if shape is not None else cfg.mesh.shape))
    if model is None:
        plan = check_config(cfg, mesh)
        model, layout, params, opt = plan.model, plan.layout, plan.params, plan.opt_state
    else:
        params, opt = (state_lib.param_shardings(model, layout, mesh, t) for t in ("params", "opt_state"))
    return types.SimpleNamespace(cfg=cfg, mesh=mesh, layout=layout, model=model, accum_gather=accum_gather,
                                 shardings=types.SimpleNamespace(params=params), grad_shardings=opt)


def gathered(exp) -> tuple[str, ...]:
    """The mesh axes the step gathers params over once per step (train.accum_gather=once
    with microbatches; grad_reduce.gathered_axes), else ()."""
    return grad_reduce.gathered_axes(exp.layout, exp.mesh, exp.shardings.params,
                                     exp.cfg.train.grad_accum_steps, exp.accum_gather)


def activations(exp, hw=None, dtype: str | None = None) -> float | None:
    """Activation bytes per device (see the module docstring); None when the model family
    gives no per-layer formula. `dtype`: computed in this dtype instead of model.dtype (the
    report's account of the CPU compile, which computes bf16 in float32)."""
    if exp.model.pipeline is not None:
        acct = pipeline_activations(exp, hw, dtype)
        return None if acct is None else acct.total
    m, b = exp.model, local_batch(exp)
    per_layer = m.family.layer_activation_bytes
    if per_layer is None:
        return None
    cfg = dataclasses.replace(m.cfg, attention=attention_on(exp, hw), dtype=dtype or m.cfg.dtype)
    sp, n = sequence_parallel(exp), context.split(exp)[0]  # n: each sequence's positions split n ways
    # each keyword only asked of a family under sequence or context parallelism
    split = {**({"sp": sp} if sp > 1 else {}), **({"context": n} if n > 1 else {})}
    if (e := experts.split(exp)[0]) > 1:  # dropless's exchanged buffers
        split["expert"] = e
    tokens = b["rows"] * cfg.seq_len / n
    kept = cfg.num_layers * per_layer(cfg, tokens, b["tensor"], cfg.remat, **split)
    if cfg.remat != "none":  # backward recomputes one layer's activations at a time
        kept += per_layer(cfg, tokens, b["tensor"], "none", **split)
    return kept + _head(exp, cfg, b["rows"] / n, b["vocab"])


def sequence_parallel(exp) -> int:
    """The tensor ranks a layout splits the residual stream [batch, length, embed] over by
    position (Megatron sequence parallelism, the *_sp presets' `length:tensor`), else 1."""
    _, axes = _shards(exp, "length")
    return _size(exp.mesh, [a for a in axes if a == "tensor"])


def pipeline_activations(exp, hw=None, dtype: str | None = None):
    """The pipelined step's activations per schedule (planner/pipeline_memory.py): a
    pipeline_memory.Account, or None without a pipeline or a per-layer formula."""
    m, b, pipe = exp.model, local_batch(exp), exp.model.pipeline
    per_layer = m.family.layer_activation_bytes
    if per_layer is None or pipe is None:
        return None
    cfg = dataclasses.replace(m.cfg, attention=attention_on(exp, hw), dtype=dtype or m.cfg.dtype)
    t, mb = cfg.seq_len, b["pipeline_rows"]
    recompute = per_layer(cfg, mb * t, b["tensor"], "none") if cfg.remat != "none" else 0.0
    inner = exp.layout.without("stage")
    pieces = _shards(exp, "length", inner)[0] * _shards(exp, "embed", inner)[0]
    stream = mb * t * _embed_dim(m) * jnp.dtype(cfg.dtype).itemsize / pieces  # one [mb, T, D]
    vocab, vocab_axes = _shards(exp, "vocab")
    # 1F1B's loss head runs on every tick, its vocabulary split over stage too where it
    # divides (pipeline_1f1b.head_layout)
    over_stage = "stage" not in vocab_axes and cfg.padded_vocab_size % (vocab * pipe.stages) == 0
    head_vocab = vocab * (pipe.stages if over_stage else 1)
    return pipeline_memory.account(
        pipe, cfg.num_layers, lambda rows: per_layer(cfg, rows * t, b["tensor"], cfg.remat), recompute, mb,
        stream, _head(exp, cfg, b["rows"], vocab), _head(exp, cfg, mb, head_vocab))


def activation_traffic(exp, hw=None) -> float | None:
    """Activation bytes the step writes for its backward pass, what the roofline's memory
    term reads: the activations, but under 1f1b/interleaved every item's residuals (written
    once each, though few are kept at once), as gpipe's."""
    if exp.model.pipeline is None:
        return activations(exp, hw)
    acct = pipeline_activations(exp, hw)
    return None if acct is None else acct.written


def _head(exp, cfg, rows: int, vocab_shards: int) -> float:
    """The loss head for `rows` rows: logits and their gradient, both in the compute dtype
    (meshtrain/loss.py writes nothing [.., V] in float32), of one chunk of positions when
    the loss runs in chunks, and then the output projection's gradient summed over the
    chunks in float32."""
    chunks = loss_chunks(exp)
    v_local = cfg.padded_vocab_size / vocab_shards
    logits = rows * cfg.seq_len // chunks * v_local * 2 * jnp.dtype(cfg.dtype).itemsize
    return logits + (v_local * _embed_dim(exp.model) * 4 if chunks > 1 else 0)


def loss_chunks(exp) -> int:
    """How many chunks of positions the loss runs in (meshtrain/loss.py): 1 when the model
    has no hidden/project seam, which then takes whole logits."""
    if not loss_lib.has_seam(exp.model.family.module):
        return 1
    return loss_lib.num_chunks(exp.model.cfg.seq_len, exp.cfg.train.loss_chunk)


def collective_bounds(exp) -> list[dict]:
    """[{kind, mesh_axes, count, bytes, what}]: the least each device must send per step
    (module docstring); `count` is how many ops the bound assumes."""
    m, mesh = exp.model, exp.mesh
    cfg = m.cfg
    compute, pbytes = jnp.dtype(cfg.dtype).itemsize, jnp.dtype(cfg.param_dtype).itemsize
    b = local_batch(exp)
    order = {a: i for i, a in enumerate(mesh.axis_names)}
    rows: dict[tuple, dict] = {}

    def add(kind, axes, count, nbytes, what):
        axes = tuple(sorted((a for a in axes if mesh.shape[a] > 1), key=order.get))
        if not axes or nbytes <= 0:
            return
        r = rows.setdefault((kind, axes), {"kind": kind, "mesh_axes": axes, "count": 0, "bytes": 0.0,
                                           "what": what})
        r["count"] += count
        r["bytes"] += nbytes

    _, batch_axes = _shards(exp, "batch")
    inner_axes = batch_axes if m.pipeline is None else _shards(exp, "batch", exp.layout.without("stage"))[1]
    grad_bytes = jnp.dtype(exp.cfg.train.grad_dtype).itemsize if exp.cfg.train.grad_dtype else 0
    once = gathered(exp)
    replicas = grad_reduce.replica_axes(exp.layout, mesh, exp.shardings.params, once)
    flat_shapes = tree_paths.flat(m.shapes)
    flat_params = tree_paths.flat(exp.shardings.params)
    flat_opt = tree_paths.flat(exp.grad_shardings)
    flat_axes = tree_paths.flat(m.axes, is_leaf=lambda x: isinstance(x, tuple))
    zero2 = exp.layout.splits_grads
    # A conv's gradient sums over the image rows too: a spatial split leaves a part on each device.
    convs, spatial = halo.conv_paths(exp), halo.spatial_axes(exp)
    positions = context.split(exp)[1]  # every weight's gradient is a sum over a split sequence's positions
    for path, shape in flat_shapes.items():
        p_axes, o_axes = _axes_of(flat_params[path]), _axes_of(flat_opt[path])
        splits = inner_axes if (m.pipeline is not None and path.startswith(m.stacked + "/")) else batch_axes
        local = math.prod(shape.shape) / _size(mesh, p_axes)
        g = compute  # the narrowest dtype gradients are computed in: a true lower bound
        rows_axes = [a for a in spatial if a not in p_axes] if path.startswith(convs) else []
        reduced = local  # what is left to reduce over the batch axes
        if rows_axes:  # over the row split first (reduce-scatter + all-gather), then 1/n of it over the batch axes
            n = _size(mesh, rows_axes)
            add("all-reduce", rows_axes, 0, 2 * (n - 1) / n * local * g, "conv gradient reduction over the row split")
            reduced = local / n
        split_axes = [a for a in positions if a not in p_axes]
        if split_axes:  # likewise over the positions' split (context parallelism)
            n = _size(mesh, split_axes)
            add("all-reduce", split_axes, 0, 2 * (n - 1) / n * reduced * g, "gradient reduction over the context split")
            reduced /= n
        reduce_axes = [a for a in splits if a not in p_axes and mesh.shape[a] > 1]
        if grad_bytes and reduce_axes and set(reduce_axes) <= set(replicas):
            g = grad_bytes  # reduced by hand in train.grad_dtype (meshtrain/grad_reduce.py)
        zero = [a for a in reduce_axes if a in o_axes]
        plain = [a for a in reduce_axes if a not in o_axes]
        # Gradient reductions: XLA combines and splits them freely, so the bound counts no ops.
        if plain:
            n = _size(mesh, plain)
            add("all-reduce", plain, 0, 2 * (n - 1) / n * reduced * g, "gradient reduction")
        if zero:
            n = _size(mesh, zero)
            stage = "ZeRO-2" if zero2 else "ZeRO-1"
            times = 1
            if zero2:  # reduce-scattered where each microbatch's (each tick's) backward makes it
                ticks = m.pipeline.ticks if (m.pipeline is not None and path.startswith(m.stacked + "/")) else 1
                times = exp.cfg.train.grad_accum_steps * ticks
            add("reduce-scatter", zero, 0, times * (n - 1) / n * local * g, f"{stage} gradient reduce-scatter")
            add("all-gather", zero, 0, (n - 1) / n * local * pbytes, f"{stage} updated-param all-gather")
        owned = experts.owned_axes(path, flat_axes[path], flat_params[path])  # tokens go to the experts
        gather = [a for a in p_axes if a in splits and mesh.shape[a] > 1 and a not in owned]
        if gather and set(gather) <= set(once):  # train.accum_gather=once
            n = _size(mesh, gather)
            g = grad_bytes or g  # reduced by hand, in train.grad_dtype when set
            add("all-gather", gather, 0, (n - 1) * local * compute,
                "FSDP weight all-gather, once per step before the microbatch loop")
            add("reduce-scatter", gather, 0, (n - 1) * local * g,
                "FSDP reduce-scatter of the accumulated gradients, once per step")
        elif gather and m.pipeline is not None and not path.startswith(m.stacked + "/"):
            # the embedding and head under a pipeline (split over stage, fsdp): run once per
            # accumulation microbatch outside the ticks; backward reuses the forward's gather.
            # 1F1B's head splits vocab over stage as stored (pipeline_1f1b.head_layout).
            if m.pipeline.one_f_one_b and flat_axes[path] == ("embed", "vocab"):
                gather = [a for a in gather if a != "stage"]
            if not gather:
                continue
            n, k = _size(mesh, gather), exp.cfg.train.grad_accum_steps
            add("all-gather", gather, 0, k * (n - 1) * local * compute,
                "table outside the pipeline gathered once per microbatch (ZeRO-3 over stage)")
            add("reduce-scatter", gather, 0, k * (n - 1) * local * g,
                "its gradient reduce-scattered once per microbatch")
        elif gather:
            n = _size(mesh, gather)
            add("all-gather", gather, 0, 2 * b["micro"] * (n - 1) * local * compute,
                "FSDP weight all-gather, forward and backward, per microbatch (ZeRO-3)")
            add("reduce-scatter", gather, 0, exp.cfg.train.grad_accum_steps * (n - 1) * local * g,
                "FSDP gradient reduce-scatter, per microbatch")
    for kind, axes, count, nbytes, what in halo.bound_rows(exp) + context.bound_rows(exp) + experts.bound_rows(exp):
        add(kind, axes, count, nbytes, what)
    if not has_stream(m):  # a classifier: no Megatron or pipeline formula (no_formula says so)
        return sorted(rows.values(), key=lambda r: (r["mesh_axes"], r["kind"]))
    t_axes = _shards(exp, "heads")[1]
    length = cfg.seq_len / context.split(exp)[0]  # the positions a device holds
    activation = b["pipeline_rows"] * length * _embed_dim(m) * compute
    stages = m.pipeline.stages if m.pipeline else 1
    if b["tensor"] > 1:
        n = b["tensor"]
        layers = cfg.num_layers // stages * b["micro"]
        add("all-reduce", t_axes, 4 * layers, 4 * layers * 2 * (n - 1) / n * activation,
            "Megatron: 2 all-reduces per layer forward, 2 backward")
        if b["vocab"] > 1:
            k, chunks = exp.cfg.train.grad_accum_steps, loss_chunks(exp)
            whole = b["rows"] * length * _embed_dim(m) * compute * k
            add("all-reduce", t_axes, (1 + chunks) * k, 2 * 2 * (n - 1) / n * whole,
                "vocab-parallel embedding: lookup forward, output projection backward per loss chunk")
    if stages > 1:  # r times round the ring under circular/interleaved: r S - 1 crossings
        r = m.pipeline.repeats
        add("collective-permute", ("stage",), 2 * b["micro"] * r,
            2 * b["micro"] * activation * (r * stages - 1) / stages,
            "pipeline: each microbatch over each stage boundary, forward and backward")
    return sorted(rows.values(), key=lambda r: (r["mesh_axes"], r["kind"]))


def has_stream(model) -> bool:
    """Whether the family pins a [batch, length, embed] residual stream (a language model)."""
    return _stream_shape(model) is not None


def _embed_dim(model) -> int:
    """The residual stream's width, [b, T, D]: read from the activations the family pins."""
    shape = _stream_shape(model)
    if shape is None:
        raise ValueError(f"model family {model.family.name!r} pins no [batch, length, embed] activation")
    return shape[-1]


def _stream_shape(model) -> tuple[int, ...] | None:
    return next((shape for _, shape, axes in model.family.activations(model.cfg, 1)
                 if tuple(axes) == ("batch", "length", "embed")), None)
