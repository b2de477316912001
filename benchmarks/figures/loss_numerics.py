"""Reproduces docs/benchmarks.md, "The loss without float32 logits".

python benchmarks/figures/loss_numerics.py [--steps 300] [--small-rows 2] [--skip-small]

The loss with its hand-written gradient (meshtrain/step/loss.py `summed_cross_entropy`: logits
in the compute dtype, float32 only inside the reductions and the gradient's element-wise
pass) against the loss it replaced (the logits upcast to float32, optax's cross entropy,
autodiff), in bf16 compute with float32 parameters, on one CPU device:

1. the loss and every gradient of one batch, for GPT-2 small (T = 1024, train.loss_chunk
   256, `--small-rows` rows) and Llama tiny (T = 128, whole logits and 4 chunks): the
   relative loss difference and, per leaf, max |new - old| / max |old|, the worst leaf
   named;
2. `--steps` steps of gpt2_tiny and llama_tiny with each loss, same data and seed: the
   largest loss difference over the curve and the last losses.

Each program is traced with one loss or the other (the module's `summed_cross_entropy` is
swapped while tracing), so both run the same step otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # meshtrain from this checkout, when not installed

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from meshtrain import config as config_lib  # noqa: E402
from meshtrain.run.experiment import Experiment  # noqa: E402
from meshtrain.step import loss as loss_lib, train_step as step_lib


def float32_autodiff_loss(logits_nv, targets_n):
    """The loss before: logits upcast to float32, optax's cross entropy, autodiff."""
    return optax.softmax_cross_entropy_with_integer_labels(logits_nv.astype(jnp.float32), targets_n).sum()


@contextlib.contextmanager
def traced_with(which: str):
    """Traces inside the block use the new loss ("new") or the one it replaced ("old")."""
    kept = loss_lib.summed_cross_entropy
    if which == "old":
        loss_lib.summed_cross_entropy = float32_autodiff_loss
    try:
        yield
    finally:
        loss_lib.summed_cross_entropy = kept


def config(name: str, **overrides):
    cfg = config_lib.load(name)
    for k, v in {"mesh.shape": "data:1", "model.dtype": "bfloat16", **overrides}.items():
        config_lib.override(cfg, k, str(v))
    return cfg


def _grads(cfg, chunk: int, which: str, params=None):
    exp = Experiment.build(cfg, devices=jax.devices()[:1])
    params = exp.init_state().params if params is None else params
    rows, t = cfg.train.batch_size, exp.model.cfg.seq_len
    tokens = np.random.default_rng(0).integers(0, exp.model.cfg.vocab_size, (rows, t + 1), dtype=np.int32)
    with traced_with(which):
        objective = step_lib.make_objective(exp.model, exp.layout, exp.mesh, loss_chunk=chunk)
        fn = jax.jit(jax.value_and_grad(lambda p, b, k: objective(p, {}, b, k)[0]))
        loss, grads = jax.device_get(fn(params, tokens, None))
    return float(loss), [np.asarray(g, np.float64) for g in jax.tree.leaves(grads)], params


def one_batch(name: str, overrides: dict, chunk: int) -> dict:
    """Part 1: the new and the old loss in bf16 compute against each other, and each
    against the float32-compute step of the same parameters (the reference both round)."""
    new, g_new, params = _grads(config(name, **overrides), chunk, "new")
    old, g_old, _ = _grads(config(name, **overrides), chunk, "old", params)
    ref, g_ref, _ = _grads(config(name, **overrides, **{"model.dtype": "float32"}), chunk, "new", params)

    def error(gs):  # |g - g_ref| / |g_ref| over all leaves together
        return float(np.sqrt(sum(((a - b) ** 2).sum() for a, b in zip(gs, g_ref))
                             / sum((b ** 2).sum() for b in g_ref)))
    between = max(float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)) for a, b in zip(g_new, g_old))
    return {"loss_new": new, "loss_rel": abs(new - old) / abs(old), "loss_f32": ref, "between": between,
            "err_new": error(g_new), "err_old": error(g_old)}


def curve(cfg, steps: int) -> dict:
    """Losses of `steps` train steps with each loss (part 2)."""
    losses = {}
    for which in ("new", "old"):
        exp = Experiment.build(cfg, devices=jax.devices()[:1])
        with traced_with(which):
            state, batches, seen = exp.init_state(), exp.train_batches(), []
            t0 = time.perf_counter()
            for _ in range(steps):
                state, metrics = exp.train_step(state, exp.put_batch(next(batches)))
                seen.append(metrics["loss"])
            losses[which] = np.asarray(jax.device_get(seen), np.float64)
            losses[which + "_s"] = time.perf_counter() - t0
    diff = np.abs(losses["new"] - losses["old"])
    return {"max_diff": float(diff.max()), "at_step": int(diff.argmax()) + 1,
            "last_new": float(losses["new"][-1]), "last_old": float(losses["old"][-1]),
            "first": float(losses["old"][0])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--small-rows", type=int, default=2, help="GPT-2 small's rows in part 1")
    ap.add_argument("--skip-small", action="store_true", help="part 1 without GPT-2 small (CPU minutes)")
    args = ap.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; bf16 compute, float32 params\n")
    print("| model | tokens | loss chunk | loss new (float32 compute) | loss new vs old | gradients new vs old, "
          "worst leaf's max diff / its max | gradient error vs float32 compute, new / old |")
    print("|---|---|---|---|---|---|---|")
    small = {"train.batch_size": args.small_rows, "model.seq_len": 1024}
    llama = {"train.batch_size": 8, "model.seq_len": 128}
    cases = [] if args.skip_small else [("gpt2 small", "gpt2_small_dp8", small, 256)]
    cases += [("llama tiny", "llama_tiny_dp8", llama, 0), ("llama tiny", "llama_tiny_dp8", llama, 32)]
    for label, name, overrides, chunk in cases:
        r = one_batch(name, overrides, chunk)
        rows, t = overrides["train.batch_size"], overrides["model.seq_len"]
        print(f"| {label} | {rows} x {t} | {chunk or 'whole'} | {r['loss_new']:.5f} ({r['loss_f32']:.5f}) | "
              f"{r['loss_rel']:.1e} | {r['between']:.1e} | {r['err_new']:.2e} / {r['err_old']:.2e} |", flush=True)
    print("\n| model | steps | first loss | last, new | last, old | largest difference (step) |")
    print("|---|---|---|---|---|---|")
    for name in ("gpt2_tiny_dp8", "llama_tiny_dp8"):
        r = curve(config(name, **{"train.steps": args.steps, "train.eval_every": 0}), args.steps)
        print(f"| {name} | {args.steps} | {r['first']:.4f} | {r['last_new']:.4f} | {r['last_old']:.4f} | "
              f"{r['max_diff']:.1e} ({r['at_step']}) |", flush=True)


if __name__ == "__main__":
    main()
