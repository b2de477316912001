"""Reproduces docs/benchmarks.md, "The loss's memory".

python benchmarks/figures/loss_memory.py [--config gpt2_small_dp8] [--chunks 0,256] [--rows 2]
                                   [--config.key=value ...]

The train step's compiled temp memory with the loss over whole logits (train.loss_chunk=0)
and over chunks of positions (meshtrain/step/loss.py), on ONE device, and how well the two
agree: loss and gradients from the same params and batch.

Defaults: gpt2_small_dp8's model and settings (bf16 compute, float32 params and Adam) on a
1-device mesh at 16 x 1024 tokens, the shape docs/performance.md quotes. Memory is
compile-only. Agreement runs the loss and its gradient (no optimizer) at --rows rows, each
chunk setting once; on a 2-core CPU a 16-row gpt2_small gradient takes minutes, so the
default is 2 rows (the chunks split positions, not rows: the comparison is the same per row).
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import numpy as np

from meshtrain import config as config_lib
from meshtrain.planner import hlo_flops
from meshtrain.run.experiment import Experiment
from meshtrain.runlog import metrics
from meshtrain.step import train_step as step_lib


def build(name: str, overrides: list[tuple[str, str]], chunk: int, rows: int | None = None) -> Experiment:
    cfg = config_lib.load(name)
    fixed = [("mesh.shape", "data:1"), ("train.batch_size", "16"), *overrides,
             ("train.loss_chunk", str(chunk))]
    if rows is not None:
        fixed.append(("train.batch_size", str(rows)))
    for key, value in fixed:
        config_lib.override(cfg, key, value)
    return Experiment.build(cfg, devices=jax.devices()[:1])


def agreement(name, overrides, chunks, rows) -> list[str]:
    """Loss and per-leaf gradient differences of each chunk setting against the first."""
    exp = build(name, overrides, chunks[0], rows)
    params = exp.init_state().params
    t = exp.model.cfg.seq_len
    tokens = np.random.default_rng(0).integers(0, exp.model.cfg.vocab_size, (rows, t + 1), dtype=np.int32)
    tokens = jax.device_put(tokens, exp.batch_sharding)
    results = []
    for chunk in chunks:
        objective = step_lib.make_objective(exp.model, exp.layout, exp.mesh, loss_chunk=chunk)
        grad_fn = jax.jit(jax.value_and_grad(lambda p, b, k: objective(p, {}, b, k)[0]))
        t0 = time.perf_counter()
        results.append(jax.device_get(grad_fn(params, tokens, None)))
        print(f"  loss_chunk={chunk}: loss and gradient in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    (loss0, grads0), lines = results[0], []
    for chunk, (loss, grads) in zip(chunks[1:], results[1:]):
        differ = []
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads0), jax.tree.leaves(grads)):
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            if not np.array_equal(a, b):  # largest difference, as a share of the largest entry
                differ.append(f"{jax.tree_util.keystr(path)} {np.abs(a - b).max() / np.abs(a).max():.1e}")
        lines.append(f"loss_chunk={chunk} vs {chunks[0]} at {rows} x {t}: loss {float(loss):.6f} vs "
                     f"{float(loss0):.6f} (relative {abs(float(loss) - float(loss0)) / abs(float(loss0)):.1e}); "
                     f"gradients: {len(jax.tree.leaves(grads)) - len(differ)} of {len(jax.tree.leaves(grads))} "
                     f"leaves bit-identical; the others' largest difference over their largest entry: "
                     f"{', '.join(differ) or '-'}")
    return lines


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description="Temp memory of the loss over whole logits and over chunks.")
    p.add_argument("--config", default="gpt2_small_dp8")
    p.add_argument("--chunks", default="0,256", help="train.loss_chunk values; the first is the reference")
    p.add_argument("--rows", type=int, default=2, help="rows for the agreement run (0: skip it)")
    args, rest = p.parse_known_args(argv)
    overrides = [tuple(a[len("--config."):].split("=", 1)) for a in rest if a.startswith("--config.")]
    chunks = [int(c) for c in args.chunks.split(",")]

    rows = []
    for chunk in chunks:
        exp = build(args.config, overrides, chunk)
        t0 = time.perf_counter()
        compiled = exp.compile()
        secs, mem = time.perf_counter() - t0, metrics.memory_report(compiled)
        c = exp.model.cfg
        logits = exp.cfg.train.batch_size * c.seq_len * c.padded_vocab_size * 4
        rows.append((chunk, mem["temp"], mem["peak_estimate"], secs, logits, hlo_flops.dot_flops(compiled)))
    b, c = exp.cfg.train.batch_size, exp.model.cfg
    print(f"{args.config} on 1 device, {b} x {c.seq_len} tokens, compute {c.dtype}, vocab "
          f"{c.padded_vocab_size}: one [B, T, V] float32 array is {rows[0][4] / 2**20:,.0f} MiB")
    print(f"{'loss_chunk':>10}  {'temp MiB':>9}  {'peak MiB':>9}  {'matmul TFLOP':>12}  {'compile s':>9}")
    for chunk, temp, peak, secs, _, flops in rows:
        print(f"{chunk:>10}  {temp / 2**20:>9,.0f}  {peak / 2**20:>9,.0f}  {flops / 1e12:>12.3f}  {secs:>9.0f}")
    for chunk, temp, *_ in rows[1:]:
        print(f"loss_chunk={chunk} saves {(rows[0][1] - temp) / 2**20:,.0f} MiB of temp memory "
              f"({(rows[0][1] - temp) / rows[0][4]:.1f} [B, T, V] float32 arrays)")
    if args.rows:
        for line in agreement(args.config, overrides, chunks, args.rows):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
