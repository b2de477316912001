"""python benchmarks/overhead.py [--config gpt2_tiny_dp2_tp4] [--pairs 60] [--warmup 5]
                                [--devices 8] [--config.key=value ...]

meshtrain's train step vs a bare-JAX step with the same math and shardings, timed
alternately in one process. The bare step is benchmarks/bare_gpt2.py's, the one bare-JAX
reference (step_cpu.py times it too): written from scratch in plain jax.numpy over the
params dict meshtrain stores (no flax, no meshtrain modules). This script plugs into it
only what is not framework: the model's numeric kernels (the LayerNorm and GELU
whose backward recomputes them, the attention kernel model.attention resolves to (XLA's
on a CPU, cuDNN's flash kernel on a GPU), and the loss's kernel (meshtrain/step/loss.py: the
logits in the compute dtype, float32 only inside its fusions, in chunks where
train.loss_chunk cuts the sequence): the same math in the same formulation,
docs/benchmarks.md "CPU step"), the optax transformation and lr schedule
(`exp.tx`, `exp.schedule`), the shardings (`exp.shardings`, `exp.grad_shardings`,
`exp.batch_sharding`) and the layout's activation specs, so it pins activations at
the places gpt2.py does and the two programs compile to the same collectives.

It prints: the loss / grad-norm / param agreement after one step from the same state
and batch; flops and collective counts of both compiled executables; then the median
of N paired, alternated step-time ratios meshtrain/bare (goal: <= 1.05).
Fake CPU devices share the machine's cores, so only ratios taken in one process,
interleaved, are meaningful (separate processes vary by about 20% here).
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import re
import statistics
import sys
import time

# meshtrain from this checkout when it is not installed: Python puts the script's folder on
# the path, not the working directory (benchmarks/gpu.py runs this as a child process).
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

import bare_gpt2  # noqa: E402  (beside this script)
from meshtrain.models import attention, gpt2  # noqa: E402
from meshtrain.step import loss  # noqa: E402

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
GOAL = 1.05  # the median ratio meshtrain/bare this script was written to hold (module docstring)


def make_bare_step(exp):
    """The reference step of bare_gpt2.py over exp's params dict, with meshtrain's kernels,
    optimizer, schedule and shardings plugged in; same signature as exp.train_step except
    that the state is a tuple (step [], params, opt_state)."""
    cfg = exp.model.cfg
    chunks = loss.num_chunks(cfg.seq_len, exp.cfg.train.loss_chunk)

    def pin(x, axes):  # the same with_sharding_constraint as meshtrain's `constrain`
        spec = exp.layout.spec(axes, "activations")
        return jax.lax.with_sharding_constraint(x, NamedSharding(exp.mesh, spec))

    def attend(q, k, v):  # [B, T, H, E] x3 -> [B, T, H, E]: the kernel model.attention resolved to
        return attention.attend(q, k, v, implementation=cfg.attention)[0]

    def loss_kernel(project, h, w, targets, pin):  # h [B, T, D], w [V, D], targets [B, T] -> []
        if chunks > 1:  # one chunk of positions at a time, as train.loss_chunk asks
            return loss.chunked_cross_entropy(project, h, w, targets, chunks, exp.layout, exp.mesh)
        return loss.cross_entropy(project(h, w, pin), targets)  # [B, T, V]; the same kernel

    def update(grads, opt_state, params, n, grad_norm):  # optax clips by its own norm
        updates, opt_state = exp.tx.update(grads, opt_state, params)
        return jax.tree.map(lambda p, u: (p + u).astype(p.dtype), params, updates), opt_state

    sh = exp.shardings
    return bare_gpt2.make_step(
        bare_gpt2.Optimizer(update, exp.schedule), (sh.step, sh.params, sh.opt_state), exp.batch_sharding,
        kernels=bare_gpt2.Kernels(gpt2.layer_norm, gpt2.gelu, attend, loss_kernel), pin=pin,
        dtype=cfg.dtype, vocab_size=cfg.vocab_size, param_shardings=sh.params,
        grad_shardings=exp.grad_shardings)


def as_tuple(state):
    return (state.step, state.params, state.opt_state)


def program_summary(compiled) -> tuple[float, dict[str, int], collections.Counter, collections.Counter]:
    """flops, {collective kind: count}, {opcode: count} and {(collective, result shape): count}
    of a compiled executable. Ops inside a while body (the layer scan) appear once in the
    text (cost_analysis counts them once too), on both sides alike."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    opcodes, signatures = collections.Counter(), collections.Counter()
    for line in compiled.as_text().splitlines():  # `[ROOT] %name = SHAPE opcode(operands), attrs`
        if re.match(r"\s*(ROOT )?%\S+ = ", line):
            rhs = re.sub(r"/\*.*?\*/", "", line.split(" = ", 1)[1])  # drop `/*index=5*/` comments
            op = re.search(r"(?:^|\s)([a-z][a-z0-9-]*)\(", rhs)
            opcodes[op.group(1)] += 1
            if op.group(1) in COLLECTIVES or op.group(1)[:-len("-start")] in COLLECTIVES:
                signatures[op.group(1), rhs[:op.start()].strip()] += 1  # shape = bytes moved
    # An async collective is `X-start` + `X-done`: count the start only.
    collectives = {k: opcodes[k] + opcodes[k + "-start"] for k in COLLECTIVES}
    return float(cost.get("flops", float("nan"))), collectives, opcodes, signatures


def rel(a, b) -> float:
    a, b = float(a), float(b)
    return abs(a - b) / max(abs(b), 1e-30)


def timed(fn, state, batch):
    """One step, blocked on: (state, metrics, wall seconds)."""
    t0 = time.perf_counter()
    state, metrics = fn(state, batch)
    jax.block_until_ready((state, metrics))
    return state, metrics, time.perf_counter() - t0


def compare_programs(mt_step, bare_step, mt_state, bare_state, batch):
    """Both steps compiled ahead of time from the same arguments, their FLOPs, collectives
    and opcodes printed and compared -> ((flops meshtrain, flops bare), collectives equal,
    opcode counts equal)."""
    summaries = {}
    for name, fn, state in (("meshtrain", mt_step, mt_state), ("bare", bare_step, bare_state)):
        t0 = time.perf_counter()
        compiled = fn.lower(state, batch).compile()
        summaries[name] = program_summary(compiled)
        print(f"{name:>9}: compile {time.perf_counter() - t0:.2f} s, flops {summaries[name][0]:.4g}, "
              f"{sum(summaries[name][2].values())} HLO instructions, collectives {summaries[name][1]}")
    (flops_m, _, ops_m, sig_m), (flops_b, _, ops_b, sig_b) = summaries["meshtrain"], summaries["bare"]
    same_coll, same_ops = sig_m == sig_b, ops_m == ops_b
    print(f"flops ratio meshtrain/bare {flops_m / flops_b:.4f}; "
          f"collectives (kind and shape) equal: {same_coll}; "
          f"instruction counts by opcode equal: {same_ops}"
          + ("" if same_ops else f" (meshtrain extra {dict(ops_m - ops_b)}, bare extra {dict(ops_b - ops_m)})"))
    return (flops_m, flops_b), same_coll, same_ops


def one_step_agreement(mt_step, bare_step, mt_state, bare_state, batch):
    """One step each from the same state and batch, the loss, gradient norm and params
    compared and printed -> (both states after it, the loss's relative difference)."""
    mt_state, mt_metrics, *_ = timed(mt_step, mt_state, batch)
    bare_state, bare_metrics, *_ = timed(bare_step, bare_state, batch)
    d_loss = rel(mt_metrics["loss"], bare_metrics["loss"])
    d_norm = rel(mt_metrics["grad_norm"], bare_metrics["grad_norm"])
    d_param = max(float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))
                  for a, b in zip(jax.tree.leaves(mt_state.params), jax.tree.leaves(bare_state[1])))
    print(f"step 1: loss meshtrain {float(mt_metrics['loss']):.7f} bare {float(bare_metrics['loss']):.7f} "
          f"rel diff {d_loss:.2e}; grad_norm rel diff {d_norm:.2e}; params max rel diff {d_param:.2e}")
    return mt_state, bare_state, d_loss


def alternate(mt_step, bare_step, mt_state, bare_state, batches, warmup: int, pairs: int):
    """Warm-up, then the two steps alternated, blocking after every step -> (meshtrain's
    step seconds, bare's, the last metrics of each)."""
    for i in range(warmup):
        mt_state, *_ = timed(mt_step, mt_state, batches[i % len(batches)])
        bare_state, *_ = timed(bare_step, bare_state, batches[i % len(batches)])
    t_mt, t_bare = [], []
    for i in range(pairs):
        batch = batches[i % len(batches)]
        mt_state, mt_metrics, dt_m = timed(mt_step, mt_state, batch)
        bare_state, bare_metrics, dt_b = timed(bare_step, bare_state, batch)
        t_mt.append(dt_m)
        t_bare.append(dt_b)
    return t_mt, t_bare, mt_metrics, bare_metrics


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description="meshtrain train step vs a bare-JAX step.")
    ap.add_argument("--config", default="gpt2_tiny_dp2_tp4")
    ap.add_argument("--pairs", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--devices", type=int, default=8, help="fake CPU devices (ignored on accelerators)")
    args, rest = ap.parse_known_args(argv)
    if args.pairs < 1 or args.warmup < 0:
        ap.error(f"--pairs must be >= 1 and --warmup >= 0; got {args.pairs} and {args.warmup}")
    jax.config.update("jax_num_cpu_devices", args.devices)  # before any JAX operation

    from meshtrain import cli
    from meshtrain.run.experiment import Experiment

    others, overrides = cli.split_overrides(rest)
    if others:
        ap.error(f"unknown flags: {' '.join(others)}")
    exp = Experiment.build(cli.load_config(args.config, overrides, "benchmarks/overhead.py"))
    cfg = exp.cfg
    m = exp.model.cfg
    unsupported = {"model.dropout": m.dropout != 0, "model.remat": m.remat != "none",
                   "model.scan_layers": not m.scan_layers, "train.grad_accum_steps": cfg.train.grad_accum_steps != 1}
    if any(unsupported.values()):
        sys.exit(f"the bare step implements dropout=0, remat=none, scan_layers, grad_accum_steps=1 "
                 f"only; change {', '.join(k for k, v in unsupported.items() if v)}")
    bare_step = make_bare_step(exp)

    print(f"config {args.config}: mesh {dict(exp.mesh.shape)}, layout {exp.layout.name!r}, "
          f"{jax.device_count()} x {jax.devices()[0].platform} devices, jax {jax.__version__}")
    print(f"model L={m.num_layers} D={m.embed_dim} H={m.num_heads} F={m.mlp_dim} V={m.padded_vocab_size} "
          f"T={m.seq_len}, batch {exp.batch_shape}, dtype {m.dtype}")

    batches = exp.train_batches()
    rows = [next(batches) for _ in range(4)]
    tokens = [exp.put_batch(r) for r in rows]  # [B, T+1] int32, sharded like the step expects

    mt_state, bare_state = exp.init_state(), as_tuple(exp.init_state())  # two copies: steps donate
    (flops_m, flops_b), same_coll, same_ops = compare_programs(exp.train_step, bare_step, mt_state, bare_state,
                                                               tokens[0])
    mt_state, bare_state, d_loss = one_step_agreement(exp.train_step, bare_step, mt_state, bare_state, tokens[0])
    t_mt, t_bare, mt_metrics, bare_metrics = alternate(exp.train_step, bare_step, mt_state, bare_state, tokens,
                                                       args.warmup, args.pairs)
    ratios = sorted(a / b for a, b in zip(t_mt, t_bare))
    q1, med, q3 = (float(np.percentile(ratios, q)) for q in (25, 50, 75))
    print(f"after {1 + args.warmup + args.pairs} steps: loss meshtrain {float(mt_metrics['loss']):.6f} "
          f"bare {float(bare_metrics['loss']):.6f}")
    print(f"step time over {args.pairs} pairs: meshtrain {1e3 * statistics.median(t_mt):.2f} ms, "
          f"bare {1e3 * statistics.median(t_bare):.2f} ms (medians)")
    print(f"RESULT {args.config}: median ratio meshtrain/bare = {med:.4f} (IQR {q1:.4f}-{q3:.4f}), "
          f"{'within' if med <= GOAL else 'ABOVE'} the {GOAL} goal; flops equal: "
          f"{rel(flops_m, flops_b) < 0.01}; collectives equal: {same_coll}; opcodes equal: {same_ops}; "
          f"loss rel diff {d_loss:.1e}")


if __name__ == "__main__":
    main(sys.argv[1:])
