"""Does a layout train the same model as one device? `meshtrain plan --verify`.

GSPMD keeps a program's arithmetic whatever the placement, so a layout's rules alone
cannot change the numbers. The train step is more than placements, though: the pipeline
schedule and its per-shard weight copies, the loss's per-shard copies and custom VJP, the
gradient reduction written by hand over the replicas (train.grad_dtype, accumulation).
A layout that sends the step down a wrong one of these trains another model, silently.
The check runs the config's own mesh and layout against one device:

    small = shrink(cfg)               every dim cut to the least the layout still divides,
                                      float32, dropout off, synthetic data, no warm-up
    ref = reference(small)            the same model on 1 device: plain layers, no pipeline,
                                      no accumulation, the loss in one piece
    params0 = init on ref; the layout's run starts from the same values
    for step in 1..N:                 the same batch into both compiled train steps
        loss, loss_ref                relative difference |loss - loss_ref| / |loss_ref|
    g = mu_1 / (1 - b1)               step 1's gradient, read from Adam's first moment, so it
                                      is the one the real step handed its optimizer (after the
                                      reduction over replicas), undone from clipping
    leaf error = max |g - g_ref| / max |g_ref|     per parameter, in model layer order

Both pass when every figure is within TOLERANCE. Everything runs on CPU devices (simulated
to the mesh's count), where float32 matmuls are exact float32 (a GPU may use TF32).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import jax
import ml_collections
import numpy as np
import optax

from meshtrain import config as config_lib, mesh as mesh_lib, tree_paths
from meshtrain.errors import UserError
from meshtrain.parallel import layouts
from meshtrain.parallel.pipeline import scan as pipeline
from meshtrain.planner import findings

TOLERANCE = 1e-5  # relative, float32: sharded sums reorder additions, nothing more
# The shrunk model's floors: small enough to run in seconds, large enough that every
# piece of the model (several heads, a padded vocabulary, two loss chunks) is there.
# The vocabulary, 61, is prime: padded to a multiple of its shards (and of 2), the table
# always has padding rows, on one device as on the mesh (the same padded size on both).
MIN_HEAD_DIM, MIN_SEQ_LEN, VOCAB = 8, 16, 61
# Simulated CPU devices meet in XLA's in-process collectives, which abort the process when
# a participant is 40 s late: on a 2-core host 256 devices ran (14 s), 512 aborted.
MAX_DEVICES = 256


def shards(layout: layouts.Layout, name: str, shape: dict) -> int:
    """The most pieces any rule table splits the logical dim `name` into on `shape`."""
    return math.lcm(*(layout.shards(name, shape, t)[0] for t in layouts.rules.TARGETS))


def shrink(cfg: ml_collections.ConfigDict, shape: dict) -> tuple[ml_collections.ConfigDict, dict]:
    """A copy of `cfg` whose model is the smallest the layout divides on `shape`, set up for
    an exact comparison; -> (config, the shrunk dims). Keeps the mesh, layout, pipeline
    and train.grad_accum_steps: what is being checked."""
    from meshtrain import models
    layout = layouts.get(cfg.layout)
    if models.family.get(cfg.model.name).task != "lm":
        return _shrink_classifier(cfg, layout, shape)
    dims = models.size_dims(cfg.model)
    sh = {name: shards(layout, name, shape) for name in layouts.VOCABULARY}
    stages, repeats = shape["stage"], max(1, cfg.pipeline.repeats)
    kv = sh["kv_heads"]
    grouped = "num_kv_heads" in dims and dims["num_kv_heads"] < dims["num_heads"]
    heads = math.lcm(sh["heads"], kv * (2 if grouped else 1), 2)
    head_dim = math.lcm(sh["head_dim"], MIN_HEAD_DIM, sh["embed"] // math.gcd(sh["embed"], heads))
    embed = heads * head_dim
    # Two loss chunks that split like the sequence.
    seq_len = math.lcm(sh["length"] * 2, MIN_SEQ_LEN)
    chunked = 0 < cfg.train.loss_chunk < dims["seq_len"]
    small = {"num_layers": stages * repeats * math.lcm(2, sh["layers"]), "num_heads": heads,
             "embed_dim": embed, "mlp_dim": sh["mlp"] * -(-2 * embed // sh["mlp"]),
             "vocab_size": VOCAB, "seq_len": seq_len}
    if "num_kv_heads" in dims:
        small["num_kv_heads"] = kv
    batch = findings.batch_quantum(cfg.train.grad_accum_steps, layout, shape, max(cfg.pipeline.microbatches, 0))
    out = cfg.copy_and_resolve_references()
    sets = {**{f"model.{key}": v for key, v in small.items()},
            "model.vocab_multiple": math.lcm(sh["vocab"], 2), "model.dtype": "float32",
            "model.param_dtype": "float32", "model.dropout": 0.0, "optim.mu_dtype": "", "optim.warmup_steps": 0,
            "optim.name": "adamw", "optim.lr_batch_size": 0,  # step 1's gradients come from Adam's first moment
            "train.batch_size": batch, "train.loss_chunk": seq_len // 2 if chunked else 0,
            "data.kind": "synthetic", "data.workers": 0, "init.from": ""}
    if cfg.train.grad_dtype:  # keep the reduction by hand, in float32
        sets["train.grad_dtype"] = "float32"
    if cfg.model.attention == "cudnn":  # a GPU kernel; CPU runs XLA's
        sets["model.attention"] = "xla"
    for key, value in sets.items():
        config_lib.override(out, key, str(value))
    return out, {**small, "batch_size": batch, "loss_chunk": out.train.loss_chunk}


def _shrink_classifier(cfg, layout, shape: dict) -> tuple[ml_collections.ConfigDict, dict]:
    """An image family's `tiny` size (16 px, 10 classes: every preset's splits divide it),
    float32, no dropout, synthetic images."""
    sh = {name: shards(layout, name, shape) for name in layouts.VOCABULARY}
    batch = findings.batch_quantum(cfg.train.grad_accum_steps, layout, shape, 0)
    out = cfg.copy_and_resolve_references()
    sets = {"model.size": "tiny", "model.vocab_multiple": math.lcm(sh["vocab"], 2), "model.dtype": "float32",
            # SGD (no decay): Adam's m / sqrt(v) would turn the rounding in gradients that are
            # zero in exact arithmetic (conv biases before BatchNorm) into whole-size steps.
            # Step 1's gradients are read back from its momentum trace.
            "optim.name": "sgd", "optim.momentum": 0.9, "optim.nesterov": False, "optim.weight_decay": 0.0,
            "optim.grad_clip": 0.0, "optim.lr": 0.05,
            "model.param_dtype": "float32", "model.dropout": 0.0, "optim.mu_dtype": "", "optim.warmup_steps": 0,
            "optim.lr_batch_size": 0, "train.batch_size": batch, "data.kind": "synthetic", "data.workers": 0,
            "init.from": ""}
    for key, value in sets.items():
        config_lib.override(out, key, str(value))
    return out, {"size": "tiny", "batch_size": batch, "loss_chunk": 0}


def reference(small: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The shrunk config as plain math on one device."""
    ref = small.copy_and_resolve_references()
    for key, value in {"mesh.shape": "data:1", "mesh.dcn": "", "layout": "dp",
                       "pipeline.microbatches": 0, "pipeline.repeats": 1, "pipeline.schedule": "gpipe",
                       "train.grad_accum_steps": 1, "train.loss_chunk": 0, "train.grad_dtype": ""}.items():
        config_lib.override(ref, key, str(value))
    return ref


def mesh_shape(cfg: ml_collections.ConfigDict) -> dict:
    """The config's mesh, every size given and no more devices than can be simulated."""
    shape = mesh_lib.parse_shape(cfg.mesh.shape)
    if -1 in shape.values():
        raise UserError(f"mesh.shape={cfg.mesh.shape!r} has an axis of size -1: --verify runs the "
                        f"config's own mesh, so give every size, e.g. --config.mesh.shape=data:8,tensor:4.")
    count = math.prod(shape.values())
    if count > MAX_DEVICES:
        raise UserError(
            f"mesh.shape={cfg.mesh.shape!r} needs {count} devices; --verify simulates at most "
            f"{MAX_DEVICES} on CPU. Verify the same layout on a smaller mesh of the same kind: the "
            f"check is of the layout, not the device count, e.g. the data axis cut down "
            f"(--config.mesh.shape=...).")
    return shape


def cpu_devices(count: int) -> list:
    """`count` CPU devices of this process, or a UserError saying how to get them."""
    have = jax.devices("cpu")
    if len(have) >= count:
        return have[:count]
    raise UserError(
        f"The mesh needs {count} devices, but this process has {len(have)} CPU devices: their "
        f"count was fixed before --verify could choose it (JAX_NUM_CPU_DEVICES or "
        f"--xla_force_host_platform_device_count in XLA_FLAGS, or JAX already started in this "
        f"process, e.g. a notebook). Run `meshtrain plan --verify` in a fresh process without "
        f"them: it simulates as many CPU devices as the mesh needs.")


class _Run:
    """One side of the comparison: an experiment, its compiled step and its state."""

    def __init__(self, cfg, devices, params, say, what: str, analysis: bool):
        from meshtrain.run.experiment import Experiment
        self.exp = exp = Experiment.build(cfg, devices=devices)
        state = exp.init_state()
        if params is not None:  # the reference's values, laid out the layout's way
            if exp.model.pipeline is not None:
                params = {**params, exp.model.stacked: pipeline.to_stages(params[exp.model.stacked],
                                                                          exp.model.pipeline)}
            state = state.replace(params=jax.device_put(params, exp.shardings.params))
        start = time.perf_counter()
        self.step = exp.compile(analysis=analysis)
        self.compile_s = time.perf_counter() - start
        say(f"verify: compiled {what} in {self.compile_s:.1f}s")
        self.state = state

    def params(self):
        return jax.device_get(self.state.params)

    def run(self, batch) -> dict:
        self.state, metrics = self.step(self.state, self.exp.put_batch(batch))
        return jax.device_get(metrics)

    def gradients(self, grad_norm: float) -> dict:
        """{parameter path: step 1's gradient} (`step_1_gradients`; call after step 1)."""
        return tree_paths.flat(step_1_gradients(self.exp, self.state, grad_norm))


def step_1_gradients(exp, state, grad_norm: float):
    """The gradients step 1 handed the optimizer (after the layout's reductions over the
    replicas), float64, a tree like the params in model layer order: Adam's first moment
    mu_1 = (1 - b1) g, with g scaled by clip / norm where its norm `grad_norm` was above
    optim.grad_clip, both undone; under SGD (a classifier's verify) the momentum trace."""
    o = exp.cfg.optim
    if o.name == "sgd":
        tree, scale = jax.device_get(optax.tree_utils.tree_get(state.opt_state, "trace")), 1.0
    else:
        unclip = grad_norm / o.grad_clip if o.grad_clip and grad_norm > o.grad_clip else 1.0
        tree, scale = jax.device_get(optax.tree_utils.tree_get(state.opt_state, "mu")), unclip / (1 - o.b1)
    if exp.model.pipeline is not None:
        tree[exp.model.stacked] = pipeline.from_stages(tree[exp.model.stacked], exp.model.pipeline)
    return jax.tree.map(lambda g: np.asarray(g, np.float64) * scale, tree)


def relative(diff: float, scale: float) -> float:
    """diff / scale; 0 when both are 0, inf when only scale is, and for NaN (a NaN passes
    no tolerance and sorts first)."""
    rel = diff / scale if scale else (math.inf if diff else 0.0)
    return math.inf if math.isnan(rel) else rel


ZERO_FLOOR = 1e-4


def compare_gradients(g: dict, ref: dict) -> list[dict]:
    """Per parameter, largest error first: rel_error = max |g - ref| / max |ref|, relative
    to the leaf's scale, so entries near zero do not blow it up. A leaf whose exact
    gradient is zero (a conv bias before BatchNorm, which the normalisation cancels) holds
    only the rounding of sums over the batch and the image, ~1e-9 of the model's largest
    gradient: its scale is floored at 1e-4 of that (ZERO_FLOOR), so an error must stay
    below 1e-9 of the largest gradient there, and is not divided by a rounding residue."""
    rows = []
    floor = ZERO_FLOOR * max((float(np.max(np.abs(r))) for r in ref.values()), default=0.0)
    for k, r in ref.items():
        diff, scale = float(np.max(np.abs(g[k] - r))), max(float(np.max(np.abs(r))), floor)
        rows.append({"param": k, "rel_error": relative(diff, scale), "max_abs_diff": diff,
                     "reference_max_abs": scale, "shape": list(r.shape)})
    return sorted(rows, key=lambda x: -x["rel_error"])


def run(name: str, cfg: ml_collections.ConfigDict, steps: int = 3, say: Callable = print) -> dict:
    """Verifies `cfg`'s layout on its mesh against one device; -> the result (`render` prints
    it; result["ok"] is the verdict). The backend must not have started with fewer CPU
    devices than the mesh (the command simulates them first)."""
    from meshtrain.run.compile_options import SHORT_RUN_STEPS
    from meshtrain.run.experiment import abstract_mesh, check_config
    wall = time.perf_counter()
    shape = mesh_shape(cfg)
    check_config(cfg, abstract_mesh(shape))  # the layout parses and the real model divides
    small, dims = shrink(cfg, shape)
    count = math.prod(shape.values())
    devices = cpu_devices(count)
    layout = layouts.get(cfg.layout)
    rules = layout.describe()
    say(f"verify: {name} on mesh {mesh_lib.format_factors(shape)} ({count} CPU devices), layout "
        f"{cfg.layout if cfg.layout == rules else f'{cfg.layout} ({rules})'}")
    say(f"verify: shrunk to {_describe_dims(dims)}; float32, dropout off, synthetic data, no warm-up")
    ref_cfg = reference(small)
    short = steps <= SHORT_RUN_STEPS  # both compile with the analysis options (compile_options.py)
    try:
        say("verify: compiling the one-device reference ...")
        ref = _Run(ref_cfg, devices[:1], None, say, "the one-device reference", short)
        say(f"verify: compiling the layout's train step on {count} devices ...")
        sharded = _Run(small, devices, ref.params(), say, "the layout's train step", short)
    except UserError as e:
        raise UserError(f"The shrunk model ({_describe_dims(dims)}) does not fit the layout: {e}") from None
    say(f"verify: running {steps} step(s) on each")
    rows, grads = [], None
    batches = ref.exp.train_batches()
    for i in range(1, steps + 1):
        batch = next(batches)
        m, r = sharded.run(batch), ref.run(batch)
        loss, ref_loss = float(m["loss"]), float(r["loss"])
        rows.append({"step": i, "loss": loss, "reference_loss": ref_loss,
                     "rel_diff": relative(abs(loss - ref_loss), abs(ref_loss))})
        if i == 1:
            grads = compare_gradients(sharded.gradients(float(m["grad_norm"])),
                                      ref.gradients(float(r["grad_norm"])))
    bad_params = [x["param"] for x in grads if x["rel_error"] > TOLERANCE]
    bad_steps = [x["step"] for x in rows if x["rel_diff"] > TOLERANCE]
    return {"config_name": name, "mesh": mesh_lib.format_shape(shape), "devices": count,
            "layout": layout.describe(), "shrunk": dims, "tolerance": TOLERANCE, "steps": rows,
            "gradients": grads, "max_loss_rel_diff": max(x["rel_diff"] for x in rows),
            "max_grad_rel_error": grads[0]["rel_error"], "mismatched_params": bad_params,
            "mismatched_steps": bad_steps, "ok": not bad_params and not bad_steps,
            "compile_s": {"layout": sharded.compile_s, "reference": ref.compile_s},
            "wall_s": time.perf_counter() - wall}


def _describe_dims(d: dict) -> str:
    if "size" in d:  # an image family, at its tiny size
        return f"size {d['size']}, batch {d['batch_size']}"
    kv = f" ({d['num_kv_heads']} kv)" if "num_kv_heads" in d else ""
    chunk = f", loss in chunks of {d['loss_chunk']}" if d["loss_chunk"] else ""
    return (f"{d['num_layers']} layers, {d['num_heads']} heads{kv}, embed {d['embed_dim']}, mlp "
            f"{d['mlp_dim']}, vocab {d['vocab_size']}, seq_len {d['seq_len']}, batch {d['batch_size']}{chunk}")


def render(r: dict, top: int = 0) -> str:
    """The result for a terminal: losses, gradient errors (all, or the `top` worst), verdict."""
    tol = r["tolerance"]
    lines = ["", "step | loss (layout)   | loss (1 device)  | rel diff"]
    for x in r["steps"]:
        flag = "" if x["rel_diff"] <= tol else "  <- differs"
        lines.append(f"{x['step']:4d} | {x['loss']:15.8f} | {x['reference_loss']:16.8f} | {x['rel_diff']:.1e}{flag}")
    width = max(len(x["param"]) for x in r["gradients"])
    lines += ["", f"{'parameter':<{width}} | step-1 gradient rel error (max |g - g_ref| / max |g_ref|)"]
    shown = r["gradients"][:top] if top else r["gradients"]
    for x in shown:
        flag = "" if x["rel_error"] <= tol else "  <- differs"
        lines.append(f"{x['param']:<{width}} | {x['rel_error']:.1e}{flag}")
    if len(shown) < len(r["gradients"]):
        lines.append(f"... {len(r['gradients']) - len(shown)} more within {tol:.0e}")
    lines.append("")
    figures = (f"max loss rel diff {r['max_loss_rel_diff']:.1e}, max gradient rel error "
               f"{r['max_grad_rel_error']:.1e} (tolerance {tol:.0e}); {r['wall_s']:.1f}s")
    if r["ok"]:
        lines.append(f"verify: PASS: the layout trains the same model as one device: {figures}")
    else:
        what = []
        if r["mismatched_params"]:
            what.append(f"gradients differ for {', '.join(r['mismatched_params'])} (largest error first)")
        if r["mismatched_steps"]:
            what.append(f"the loss differs at step(s) {', '.join(map(str, r['mismatched_steps']))}")
        lines.append(f"verify: FAIL: {'; '.join(what)}: {figures}")
    return "\n".join(lines)
