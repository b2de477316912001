"""What a layout should cost by the formulas, from the config alone (nothing compiled).

Memory per device (bytes), for fp32 master weights:
  params       sum over leaves of size / (shards of its params spec) x param bytes
  optimizer    its moments (optim.moment_dtypes: AdamW and LAMB 2, SGD and LARS with
               momentum 1) x size / (shards of its opt_state spec) x param bytes (the
               first moment in optim.mu_dtype's bytes when set)
  gradients    size / (shards of its grads spec) x param bytes: the params' sharding (the
               backward writes them there), or split like the moments under a layout
               whose grads table reduce-scatters each layer's gradient inside the backward
               pass (ZeRO-2, parallel/layouts/rules.py); plus an fp32 accumulator at the
               optimizer's sharding when train.grad_accum_steps > 1; with
               train.accum_gather=once (`gathered`) the accumulator has the gathered
               params' sharding (fsdp struck), and the gathered params themselves (matrices
               in the compute dtype) count here too: both live through the microbatch loop;
               with train.grad_compression's error feedback, its buffers: (1 + 1/c) x the
               local gradient's values x 4 bytes (parallel/compression.py)
  activations  layers on the device x the family's per-layer bytes (Korthikanti et al.
               2022, at the remat policy) for the tokens one microbatch puts on a device
               (the residual stream's share divided by tensor under sequence parallelism;
               a row's T / n under context parallelism, with the other devices' keys and
               values and the context attention's score blocks: planner/context.py),
               plus one layer's full activations when a remat policy recomputes them, plus
               the logits and their gradient (compute dtype): of one chunk of train.loss_chunk positions when the loss runs in chunks
               (meshtrain/step/loss.py), with then the output projection's gradient summed
               over the chunks in float32; under a pipeline, what each schedule keeps
               (planner/pipeline_memory.py: gpipe and circular every microbatch, 1f1b and
               interleaved the few in flight)
On a plain data-parallel mesh these reduce to ZeRO's stage formulas (arXiv 1910.02054):
stage 0 (dp) 16 Psi, stage 1 (zero1) 8 Psi + 8 Psi / N, stage 2 (zero2) 4 Psi + 12 Psi / N,
stage 3 (fsdp) 16 Psi / N with fp32 gradients and no microbatching. (XLA may split zero1's
gradients inside the backward pass of its own accord: it propagates the optimizer's
sharding back into the layer scan when nothing pins the gradient whole; the formula
counts what the layout asks for.)

Collective lower bounds: planner/bounds.py.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from meshtrain.errors import UserError
from meshtrain.models import remat
from meshtrain.parallel import compression, diloco, grad_reduce
from meshtrain.parallel.layouts.rules import mesh_axes_of
from meshtrain.planner import context, experts, host_offload, pipeline_memory
from meshtrain.planner.split_cost import group_size, local_batch, split_over
from meshtrain.step import loss as loss_lib, optim, state as state_lib, train_step as step_lib

def spec_axes(sharding) -> tuple[str, ...]:
    """The mesh axes a NamedSharding splits its array over, any dim."""
    return tuple(a for s in sharding.spec for a in mesh_axes_of(s))


def _elements(exp, shardings, whole=()) -> list[float]:
    """Each parameter's elements on a device under `shardings` (params, opt_state or grads),
    kept whole over the mesh axes `whole`."""
    return [math.prod(s.shape) / group_size(exp.mesh.shape, [a for a in spec_axes(sh) if a not in whole])
            for s, sh in zip(jax.tree.leaves(exp.model.shapes), jax.tree.leaves(shardings))]


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
    """Per-device bytes on the device by the formulas in the module docstring, with the
    attention kernel the run would use on `hw` (`attention_on`), and under train.offload
    the device's share of the state (planner/host_offload.py)."""
    state = state_bytes(exp)
    return {**host_offload.device_shares(exp, state), "activations": activations(exp, hw)}


def state_bytes(exp) -> dict[str, float]:
    """Per-device bytes of the params, optimizer state and gradients, wherever they live,
    and each one's share in the stacked layers ("stacked": {name: fraction})."""
    m = exp.model
    pbytes = jnp.dtype(m.cfg.param_dtype).itemsize
    p_el, o_el = _elements(exp, exp.shardings.params), _elements(exp, exp.grad_shardings)
    params, opt = sum(p_el), sum(o_el)
    split = sum(_elements(exp, state_lib.param_shardings(m, exp.layout, exp.mesh, "grads")))
    grads = split * pbytes + (opt * 4 if exp.cfg.train.grad_accum_steps > 1 else 0)
    feedback = compression.state_shapes(exp.reduction.compression, exp.mesh)  # a row a device
    grads += sum(s.shape[1] * 4 for s in feedback.values())
    once = gathered(exp)
    if once:  # accumulator and gathered params at the params' sharding without `once`
        wbytes = [jnp.dtype(d).itemsize for d in jax.tree.leaves(step_lib.produced_dtypes(m))]
        grads += sum(n * (4 + w) for n, w in zip(_elements(exp, exp.shardings.params, once), wbytes)) - opt * 4
    moments = sum(jnp.dtype(d).itemsize for d in optim.moment_dtypes(exp.cfg.optim, m.cfg.param_dtype))
    dil = getattr(exp, "diloco", None)
    if dil is not None:  # DiLoCo: the replica's own params beside the outer ones, and its piece of the momentum
        params, extra = 2 * params, params * 4 / dil.replicas if dil.outer_momentum else 0
    else:
        extra = 0
    in_stack = [getattr(path[0], "key", None) == m.stacked
                for path, _ in jax.tree_util.tree_flatten_with_path(m.shapes)[0]]

    def stacked(elements):
        return sum(n for n, s in zip(elements, in_stack) if s) / sum(elements) if sum(elements) else 0.0
    return {"params": params * pbytes, "optimizer": opt * moments + extra, "gradients": grads,
            "stacked": {"params": stacked(p_el), "optimizer": stacked(o_el), "gradients": stacked(p_el)}}


def abstract_experiment(cfg, model=None, layout=None, accum_gather: str = "each", shape=None):
    """What `memory` reads of an Experiment, on an abstract mesh of `shape` (default
    cfg.mesh.shape; no devices, nothing compiled: 64 devices plan on a laptop): from `cfg`
    checked by experiment.check_config, or from a given `model` (a state.ModelDef, its
    pipeline as it is) and `layout`."""
    import types
    from meshtrain import mesh as mesh_lib
    from meshtrain.run.experiment import abstract_mesh, check_config
    mesh = abstract_mesh(mesh_lib.parse_shape(shape if shape is not None else cfg.mesh.shape))
    if model is None:
        plan = check_config(cfg, mesh)
        model, layout, params, opt = plan.model, plan.layout, plan.params, plan.opt_state
    else:
        params, opt = (state_lib.param_shardings(model, layout, mesh, t) for t in ("params", "opt_state"))
    reduction = grad_reduce.of_run(cfg.train, accum_gather, layout, mesh,
                                         mesh_lib.parse_dcn(cfg.mesh.dcn, dict(mesh.shape)), model.shapes, params,
                                         step_lib.replica_dtypes(model, cfg.train.grad_accum_steps),
                                         bool(cfg.diloco.every))
    dcn = mesh_lib.parse_dcn(cfg.mesh.dcn, dict(mesh.shape))
    dil = diloco.resolve(cfg.diloco, cfg.train, layout, dict(mesh.shape), dcn,
                         grad_reduce.replica_axes(layout, mesh, params), opt, bool(model.stats_shapes),
                         model.pipeline is not None, diloco.stack_of(model.stacked, model.shapes, params))
    return types.SimpleNamespace(cfg=cfg, mesh=mesh, layout=layout, model=model, accum_gather=accum_gather,
                                 shardings=types.SimpleNamespace(params=params), grad_shardings=opt,
                                 reduction=reduction, diloco=dil)


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
    cfg = dataclasses.replace(m.cfg, attention=attention_on(exp, hw), dtype=dtype or m.cfg.dtype,
                              remat=remat.on_device(m.cfg.remat))
    n, split = layer_splits(exp)
    tokens = b["rows"] * cfg.seq_len / n
    kept = cfg.num_layers * per_layer(cfg, tokens, b["tensor"], cfg.remat, **split)
    if cfg.remat != "none":  # backward recomputes one layer's activations at a time
        kept += per_layer(cfg, tokens, b["tensor"], "none", **split)
    return kept + _head(exp, cfg, b["rows"] / n, b["vocab"])


def offloaded_activations(exp) -> float | None:
    """Bytes per device model.remat=offload_* keeps in host memory: every layer's tagged
    activations (all four under offload_dots) for the tokens one microbatch puts on a
    device, in the compute dtype (Family.tagged_elements); 0 without an offload policy;
    None where not counted (a family without tags, a pipeline)."""
    m = exp.model
    if not remat.offloads(m.cfg.remat):
        return 0.0
    if m.family.tagged_elements is None or m.pipeline is not None:
        return None
    b, n = local_batch(exp), layer_splits(exp)[0]
    tags = remat.offloaded_tags(m.cfg.remat) or remat.TAGS
    per_token = sum(whole + split / b["tensor"] for tag, (whole, split) in m.family.tagged_elements(m.cfg).items()
                    if tag in tags)
    return m.cfg.num_layers * b["rows"] * m.cfg.seq_len / n * per_token * jnp.dtype(m.cfg.dtype).itemsize


def layer_splits(exp) -> tuple[int, dict]:
    """(n: each sequence's positions split n ways by context parallelism, the keywords of
    layer_activation_bytes for this layout: sp, context and expert, each only where it
    splits, so a family is asked only of what it runs under)."""
    sp, n = sequence_parallel(exp), context.split(exp)[0]
    split = {**({"sp": sp} if sp > 1 else {}), **({"context": n} if n > 1 else {})}
    if (e := experts.split(exp)[0]) > 1:  # dropless's exchanged buffers
        split["expert"] = e
    return n, split


def sequence_parallel(exp) -> int:
    """The tensor ranks a layout splits the residual stream [batch, length, embed] over by
    position (Megatron sequence parallelism, the *_sp presets' `length:tensor`), else 1."""
    return exp.mesh.shape["tensor"] if "tensor" in split_over(exp.layout, exp.mesh.shape, "length")[1] else 1


def pipeline_activations(exp, hw=None, dtype: str | None = None):
    """The pipelined step's activations per schedule (planner/pipeline_memory.py): a
    pipeline_memory.Account, or None without a pipeline or a per-layer formula."""
    m, b, pipe = exp.model, local_batch(exp), exp.model.pipeline
    per_layer = m.family.layer_activation_bytes
    if per_layer is None or pipe is None:
        return None
    cfg = dataclasses.replace(m.cfg, attention=attention_on(exp, hw), dtype=dtype or m.cfg.dtype,
                              remat=remat.on_device(m.cfg.remat))
    t, mb = cfg.seq_len, b["pipeline_rows"]
    recompute = per_layer(cfg, mb * t, b["tensor"], "none") if cfg.remat != "none" else 0.0
    inner = exp.layout.without("stage")
    pieces = split_over(inner, exp.mesh.shape, "length")[0] * split_over(inner, exp.mesh.shape, "embed")[0]
    stream = mb * t * embed_dim(m) * jnp.dtype(cfg.dtype).itemsize / pieces  # one [mb, T, D]
    vocab, vocab_axes = split_over(exp.layout, exp.mesh.shape, "vocab")
    # 1F1B's loss head runs on every tick, its vocabulary split over stage too where it
    # divides (schedule_1f1b.head_layout)
    over_stage = "stage" not in vocab_axes and cfg.padded_vocab_size % (vocab * pipe.stages) == 0
    head_vocab = vocab * (pipe.stages if over_stage else 1)
    w_reads = m.family.weight_input_bytes
    return pipeline_memory.account(
        pipe, cfg.num_layers, lambda rows: per_layer(cfg, rows * t, b["tensor"], cfg.remat), recompute, mb,
        stream, _head(exp, cfg, b["rows"], vocab), _head(exp, cfg, mb, head_vocab),
        weight_inputs=w_reads and (lambda rows: w_reads(cfg, rows * t, b["tensor"])))


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
    (meshtrain/step/loss.py writes nothing [.., V] in float32), of one chunk of positions when
    the loss runs in chunks, and then the output projection's gradient summed over the
    chunks in float32."""
    chunks = loss_chunks(exp)
    v_local = cfg.padded_vocab_size / vocab_shards
    logits = rows * cfg.seq_len // chunks * v_local * 2 * jnp.dtype(cfg.dtype).itemsize
    return logits + (v_local * embed_dim(exp.model) * 4 if chunks > 1 else 0)


def loss_chunks(exp) -> int:
    """How many chunks of positions the loss runs in (meshtrain/step/loss.py): 1 when the model
    has no hidden/project seam, which then takes whole logits."""
    if not loss_lib.has_seam(exp.model.family.module):
        return 1
    return loss_lib.num_chunks(exp.model.cfg.seq_len, exp.cfg.train.loss_chunk)


def has_stream(model) -> bool:
    """Whether the family pins a [batch, length, embed] residual stream (a language model)."""
    return _stream_shape(model) is not None


def embed_dim(model) -> int:
    """The residual stream's width, [b, T, D]: read from the activations the family pins."""
    shape = _stream_shape(model)
    if shape is None:
        raise ValueError(f"model family {model.family.name!r} pins no [batch, length, embed] activation")
    return shape[-1]


def _stream_shape(model) -> tuple[int, ...] | None:
    return next((shape for _, shape, axes in model.family.activations(model.cfg, 1)
                 if tuple(axes) == ("batch", "length", "embed")), None)
