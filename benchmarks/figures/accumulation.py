"""Reproduces docs/benchmarks.md, "Gradient accumulation under FSDP".

python benchmarks/figures/accumulation.py [--config gpt2_tiny_fsdp8] [--grad_accum_steps 4] [--steps 3]
                                    [--pairs 0] [--config.key=value ...]

train.accum_gather=each vs once on one config, in one process: per step, the collectives
each device sends by kind and mesh axes (from the compiled HLO, loop trip counts
included: planner/hlo.py), the planner's bound for the all-gathers, XLA's peak memory
estimate, and the losses of --steps steps beside those of one microbatch. With --pairs N
it also times N alternated steps of each and prints the median ratio once/each (on
simulated CPU devices the collectives are memory copies: the ratio says little about a
GPU's network).
"""

from __future__ import annotations

import argparse
import statistics
import time

from meshtrain import cli, mesh as mesh_lib


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="gpt2_tiny_fsdp8")
    p.add_argument("--grad_accum_steps", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--pairs", type=int, default=0)
    args, rest = p.parse_known_args()
    others, overrides = cli.split_overrides(rest)
    if others:
        p.error(f"unknown flags: {' '.join(others)}")
    cfg = cli.load_config(args.config, overrides, "benchmarks/figures/accumulation.py")
    mesh_lib.simulate_cpu_devices(mesh_lib.parse_shape(cfg.mesh.shape))

    import jax
    import numpy as np

    from meshtrain.planner import bounds, hlo
    from meshtrain.run.experiment import Experiment
    from meshtrain.runlog import metrics

    runs = {}
    for mode, k in (("each", args.grad_accum_steps), ("once", args.grad_accum_steps), ("k=1", 1)):
        c = cli.load_config(args.config, overrides + [("train.grad_accum_steps", str(k)), (
            "train.accum_gather", "each" if mode == "k=1" else mode)], "benchmarks/figures/accumulation.py")
        exp = Experiment.build(c)
        state = exp.init_state()
        batches = [exp.put_batch(next(it)) for it in [exp.train_batches()] for _ in range(args.steps)]
        step = exp.train_step.lower(state, batches[0]).compile()
        losses = []
        for batch in batches:
            state, m = step(state, batch)
            losses.append(float(m["loss"]))
        runs[mode] = (exp, step, state, batches[0], np.array(losses))
        if mode == "k=1":
            continue
        print(f"{args.config}, {k} accumulation steps, train.accum_gather={mode}:")
        for r in hlo.collective_table(step, exp.mesh, lambda d: 0):
            print(f"  {r['kind']:<15} over {'+'.join(r['mesh_axes']):<12} {r['count']:>4} ops "
                  f"{r['bytes']:>12,.0f} bytes sent per device per step")
        bound = sum(r["bytes"] for r in bounds.collective_bounds(exp) if r["kind"] == "all-gather")
        peak = metrics.memory_report(step)["peak_estimate"]
        print(f"  all-gather bound (planner/bounds.py) {bound:,.0f}; XLA peak estimate {peak / 2**20:.2f} MiB")
    ref = runs["k=1"][4]
    for mode in ("each", "once"):
        loss = runs[mode][4]
        print(f"losses {mode}: {', '.join(f'{x:.7f}' for x in loss)}; largest relative difference from "
              f"1 microbatch {np.max(np.abs(loss / ref - 1)):.1e}")
    print(f"losses 1 microbatch: {', '.join(f'{x:.7f}' for x in ref)}")
    print(f"once vs each: largest relative difference {np.max(np.abs(runs['once'][4] / runs['each'][4] - 1)):.1e}")
    if args.pairs:
        ratios = []
        for _ in range(args.pairs):
            times = {}
            for mode in ("each", "once"):
                _, step, state, batch, _ = runs[mode]
                t0 = time.perf_counter()
                state, m = step(state, batch)
                jax.block_until_ready(m["loss"])
                times[mode] = time.perf_counter() - t0
                runs[mode] = (runs[mode][0], step, state, batch, runs[mode][4])
            ratios.append(times["once"] / times["each"])
        print(f"step time once/each, median of {args.pairs} alternated pairs: {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
