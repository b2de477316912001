"""python benchmarks/step_cpu.py [--pairs 30] [--warmup 5] [--fsdp 8,1] [--profile]
                                [--config.key=value ...]
python benchmarks/step_cpu.py --peer levanter      # in a venv with levanter, not meshtrain

The CPU train step of a 4 x 128 GPT-2 (gpt2 family: 4 layers, embed 128, 4 heads, mlp 512,
vocab 256, seq_len 128; batch 32, float32), timed side by side in one process against a
bare JAX step of the same model: benchmarks/bare_gpt2.py, the one bare-JAX reference
(overhead.py times it too, with meshtrain's kernels plugged in), here with its defaults:
jax.numpy and jax.nn only (no flax, no optax, no meshtrain), so the same reference also
runs beside a peer framework in that framework's own environment, and the bare step is the
yardstick both ratios share.

Default mode, for each mesh fsdp:N of --fsdp (N simulated CPU devices, layout fsdp; N = 1
is one device): meshtrain's compiled `Experiment.train_step` and the bare step, alternated step
by step after warm-up. It prints the loss of both from the same initial parameters (the
bare step is given meshtrain's), the median step time of each and the median of the
paired ratios meshtrain/bare, with its interquartile range; with --profile, the XLA ops
of meshtrain's step that take the most time in a jax.profiler trace, with the JAX
operation each came from.

--peer levanter: Levanter's GPT-2 (its Gpt2Config/Gpt2LMHeadModel with the same sizes,
FSDP over the simulated devices, AdamW, no gradient checkpointing) against the bare step
with its own initial parameters: the ratio levanter/bare.

The bare step (bare_gpt2.make_step with its default kernels, bare_gpt2.adamw and the FSDP
shardings and batch-dim pins this script gives it), written as a JAX user would first write it:
  pre-LayerNorm blocks under lax.scan, jax.nn.dot_product_attention(is_causal=True),
  jax.nn.gelu(approximate=True) (GPT-2's gelu_new), tied embedding, mean next-token cross
  entropy from jax.nn.log_softmax, AdamW (b1 .9, b2 .95, eps 1e-8, weight decay 0.1 on
  matrices only, global-norm clipping at 1.0, warmup-cosine learning rate) by hand;
  parameters, gradients and moments sharded over the fsdp axis on one of their dims, the
  batch and the activations on the batch dim.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import pathlib
import re
import tempfile
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import bare_gpt2  # beside this script; it needs jax alone, as --peer levanter does

L, D, H, F, V, T, B = 4, 128, 4, 512, 256, 128, 32
OVERRIDES = [f"--config.model.num_layers={L}", f"--config.model.embed_dim={D}",
             f"--config.model.num_heads={H}", f"--config.model.mlp_dim={F}",
             f"--config.model.vocab_size={V}", f"--config.model.seq_len={T}",
             f"--config.train.batch_size={B}", "--config.model.dtype=float32"]
LR, MIN_LR, WARMUP, STEPS, WD, B1, B2, EPS, CLIP = 3e-3, 3e-4, 30, 300, 0.1, 0.9, 0.95, 1e-8, 1.0


# ---- the bare reference: benchmarks/bare_gpt2.py with its plain-JAX defaults --------------

SIZES = dict(layers=L, embed=D, heads=H, mlp=F, vocab=V, seq_len=T)
ADAMW = bare_gpt2.adamw(lr=LR, min_lr=MIN_LR, warmup=WARMUP, steps=STEPS, b1=B1, b2=B2, eps=EPS,
                        weight_decay=WD, clip=CLIP)


def fsdp_spec(path, x, n: int) -> P:
    """The first dim (after the stacked layers) that n devices divide, over `fsdp`."""
    for dim in range(bare_gpt2.stacked(path), x.ndim):
        if x.shape[dim] % n == 0:
            return P(*[None] * dim, "fsdp")
    return P()


def make_bare_step(mesh: Mesh):
    """-> (jitted step((step, params, (mu, nu)), tokens [B, T+1]) -> (state, {"loss": []}),
    shardings of the state, of the batch): the reference's default kernels, AdamW by hand,
    FSDP shardings of its own."""
    batch_sh = NamedSharding(mesh, P("fsdp"))

    def pin(x, axes):  # activations on their batch dim; the embedding table stays as stored
        return jax.lax.with_sharding_constraint(x, batch_sh) if axes[0] == "batch" else x

    specs = jax.tree_util.tree_map_with_path(lambda path, x: fsdp_spec(path, x, mesh.shape["fsdp"]),
                                             jax.eval_shape(lambda k: bare_gpt2.init(k, **SIZES), jax.random.key(0)))
    param_sh = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    state_sh = (NamedSharding(mesh, P()), param_sh, (param_sh, param_sh))
    # The loss alone comes out, as the races read nothing else.
    return bare_gpt2.make_step(ADAMW, state_sh, batch_sh, pin=pin, metrics=("loss",)), state_sh, batch_sh


def bare_state(params, state_sh):
    return jax.device_put((jnp.zeros((), jnp.int32), params, bare_gpt2.adamw_init(params)), state_sh)


# ---- timing ------------------------------------------------------------------------------

def timed(fn, state, batch):
    t0 = time.perf_counter()
    state, out = fn(state, batch)
    jax.block_until_ready((state, out))
    return state, out, time.perf_counter() - t0


def race(name, where, fn_a, state_a, batches_a, fn_b, state_b, batches_b, warmup: int, pairs: int) -> None:
    """Alternates A and B, blocking after each step; prints medians and the paired ratio."""
    for i in range(warmup):
        state_a, *_ = timed(fn_a, state_a, batches_a[i % len(batches_a)])
        state_b, *_ = timed(fn_b, state_b, batches_b[i % len(batches_b)])
    t_a, t_b = [], []
    for i in range(pairs):
        state_a, _, dt_a = timed(fn_a, state_a, batches_a[i % len(batches_a)])
        state_b, _, dt_b = timed(fn_b, state_b, batches_b[i % len(batches_b)])
        t_a.append(dt_a)
        t_b.append(dt_b)
    ratios = [a / b for a, b in zip(t_a, t_b)]
    q1, med, q3 = (float(np.percentile(ratios, q)) for q in (25, 50, 75))
    a, b = name.split("/")
    print(f"RESULT {name} {where}: {a} {1e3 * statistics.median(t_a):.1f} ms, "
          f"{b} {1e3 * statistics.median(t_b):.1f} ms (medians of {pairs}); "
          f"median ratio {name} = {med:.3f} (IQR {q1:.3f}-{q3:.3f})")


def top_ops(fn, state, batch, steps: int = 5, top: int = 8):
    """Traces `steps` steps with jax.profiler and prints the XLA ops with the most time per
    step (summed over devices), each with the op_name JAX gave the HLO it came from."""
    what = {}  # HLO instruction -> its op_name metadata, from the compiled program
    for line in fn.lower(state, batch).compile().as_text().splitlines():
        m = re.match(r"\s*(?:ROOT )?%(\S+) = .*?op_name=\"([^\"]*)\"", line)
        if m:
            what[m.group(1)] = m.group(2).replace("jit(train_step)/", "")
    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp)
        for _ in range(steps):
            state, out = fn(state, batch)
            jax.block_until_ready((state, out))
        jax.profiler.stop_trace()
        trace = json.load(gzip.open(next(pathlib.Path(tmp).rglob("*.trace.json.gz"))))
    total, count = collections.Counter(), collections.Counter()
    waits = 0.0  # a simulated device's collective lasts until the slowest one arrives
    for e in trace["traceEvents"]:
        if e.get("ph") != "X" or e["name"].startswith("while"):  # a `while` spans its body's ops
            continue
        if e["name"].startswith(("all-", "reduce-scatter", "collective-permute")):
            waits += e["dur"] / 1e3 / steps
        elif e["name"] in what:
            total[e["name"]] += e["dur"] / 1e3 / steps
            count[e["name"]] += 1
    print(f"top XLA ops, ms per step summed over devices ({sum(total.values()):.0f} ms of compute in "
          f"all; collectives, waits included, {waits:.0f} ms):")
    for name, ms in total.most_common(top):
        print(f"  {ms:8.1f} ms  {count[name] // steps:3d}x  {name}: {what[name][:100]}")
    return state


def token_rows(seed: int = 0) -> np.ndarray:
    """Four batches [B, T+1] of random token ids."""
    return np.random.default_rng(seed).integers(0, V, (4, B, T + 1), dtype=np.int32)


def run_meshtrain(args, rest) -> None:
    from meshtrain import cli
    from meshtrain.run.experiment import Experiment

    others, overrides = cli.split_overrides(OVERRIDES + rest)
    if others:
        sys.exit(f"unknown flags: {' '.join(others)}")
    cfg = cli.load_config("gpt2_tiny_fsdp8", overrides, "benchmarks/step_cpu.py")
    print(f"jax {jax.__version__}, {jax.device_count()} simulated CPU devices; model L={L} D={D} H={H} "
          f"F={F} V={V} T={T}, batch {B}, float32")
    for n in map(int, args.fsdp.split(",")):
        devices = jax.devices()[:n]
        exp = Experiment.build(cfg, devices=devices, mesh_shape=f"fsdp:{n}")
        bare, state_sh, batch_sh = make_bare_step(Mesh(np.asarray(devices), ("fsdp",)))
        batches = [exp.put_batch(r) for r in token_rows()]
        bare_batches = [jax.device_put(r, batch_sh) for r in token_rows()]
        mt = exp.init_state()
        bs = bare_state(jax.device_get(mt.params), state_sh)  # the same initial parameters
        t0 = time.perf_counter()
        mt, metrics, _ = timed(exp.train_step, mt, batches[0])
        bs, bare_metrics, _ = timed(bare, bs, bare_batches[0])
        print(f"mesh fsdp:{n}: first steps (with compiles) {time.perf_counter() - t0:.1f} s; step-1 loss "
              f"meshtrain {float(metrics['loss']):.7f} bare {float(bare_metrics['loss']):.7f}")
        race("meshtrain/bare", f"fsdp:{n}", exp.train_step, mt, batches, bare, bs, bare_batches, args.warmup, args.pairs)
        if args.profile:
            top_ops(exp.train_step, exp.init_state(), batches[0])


def run_levanter(args) -> None:
    import equinox as eqx
    import haliax as hax
    import optax
    from levanter.models.gpt2 import Gpt2Config
    from levanter.models.lm_model import LmExample

    print(f"jax {jax.__version__}, {jax.device_count()} simulated CPU devices; levanter, same model")
    n = jax.device_count()
    mesh = Mesh(np.asarray(jax.devices()), ("fsdp",))
    config = Gpt2Config(seq_len=T, hidden_dim=D, num_layers=L, num_heads=H, mlp_scale=F // D,
                        gradient_checkpointing=False, use_flash_attention=False)
    Vocab, Pos, Batch = hax.Axis("vocab", V), config.Pos, hax.Axis("batch", B)
    axis_map = {"batch": "fsdp", "embed": "fsdp"} if n > 1 else {}
    tx = optax.chain(optax.clip_by_global_norm(CLIP), optax.adamw(
        optax.warmup_cosine_decay_schedule(0.0, LR, WARMUP, STEPS, MIN_LR), b1=B1, b2=B2, eps=EPS,
        weight_decay=WD))
    with mesh, hax.axis_mapping(axis_map):
        model = hax.named_jit(lambda k: config.build(Vocab, key=k), axis_resources=axis_map)(jax.random.PRNGKey(0))
        opt_state = hax.named_jit(lambda m: tx.init(eqx.filter(m, eqx.is_array)))(model)

        def loss_fn(model, tokens):
            ex = LmExample.causal(hax.named(tokens[:, :-1], (Batch, Pos)))
            return model.compute_loss(ex, reduction=hax.mean).scalar()

        @hax.named_jit(axis_resources=axis_map, donate_args=(True, False))
        def step(state, tokens):
            model, opt_state = state
            loss, grads = eqx.filter_value_and_grad(loss_fn)(model, tokens)
            updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
            return (eqx.apply_updates(model, updates), opt_state), loss

        bare, state_sh, batch_sh = make_bare_step(mesh)
        bs = bare_state(bare_gpt2.init(jax.random.key(0), **SIZES), state_sh)
        batches = [jax.device_put(r, batch_sh) for r in token_rows()]
        race("levanter/bare", f"fsdp:{n}", step, (model, opt_state), batches, bare, bs, batches, args.warmup, args.pairs)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description="meshtrain's CPU train step vs a bare JAX step.")
    ap.add_argument("--pairs", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    ap.add_argument("--fsdp", default="8,1", help="comma list of mesh sizes (fsdp:N, layout fsdp) to time")
    ap.add_argument("--profile", action="store_true", help="also print meshtrain's top XLA ops")
    ap.add_argument("--peer", choices=("", "levanter"), default="")
    args, rest = ap.parse_known_args(argv)
    jax.config.update("jax_num_cpu_devices", args.devices)  # before any JAX operation
    if args.peer:
        run_levanter(args)
    else:
        run_meshtrain(args, rest)


if __name__ == "__main__":
    main(sys.argv[1:])
