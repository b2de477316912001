"""python benchmarks/pipeline.py [--stages 4] [--microbatches 4,8,16,32] [--repeats 1,2]
                                [--layers 8] [--batch 64]

The pipeline bubble, memory and communication, read from compiled programs (no timing).

In the SPMD form every stage computes on every tick, so the bubble is not idle time
but wasted FLOPs: a stage computes on zeros while it waits. For each (M, r) this
compiles the train step of a GPT-2 tiny with `--layers` layers on a `stage:S` mesh
of fake CPU devices, with the tick loop and the layers unrolled so that
`cost_analysis` counts every tick (it counts a while body once), and compares:

    executed  E    = flops per device x S, pipelined over S stages
    useful    U_M  = flops of the same program with one stage (same M, r; no bubble)
    head etc. U_nb = flops outside the layers (unpipelined step at L and L/2 layers)
    measured bubble = (E - U_M) / (E - U_nb)   wasted share of the layer work
    formula         = (S - 1) / (r*M + S - 1)

U_M, not the unpipelined step, is the useful work: XLA spends a few percent more
element-wise FLOPs on a batch cut into M microbatches than on the whole batch (its
fusion choices depend on the shapes), with or without stages. That cost of
microbatching is reported on its own, as U_M / U - 1.

It also reports, from the normal (rolled) program, the per-device peak memory
estimate (temp + arguments + outputs - aliased) and the collectives per step by
kind (meshtrain.hlo, loop trip counts included). Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402

from meshtrain import config as config_lib, hlo, reporting, step as step_lib  # noqa: E402
from meshtrain.experiment import Experiment  # noqa: E402


def make_config(layers: int, batch: int, mesh: str, layout: str, m: int = 0, r: int = 1):
    cfg = config_lib.load("gpt2_tiny_dp8")
    for key, value in {"model.num_layers": layers, "train.batch_size": batch, "mesh.shape": mesh,
                       "layout": layout, "model.scan_layers": False, "pipeline.microbatches": m,
                       "pipeline.repeats": r,
                       "pipeline.schedule": "circular" if r > 1 else "gpipe"}.items():
        config_lib.override(cfg, key, str(value))
    return cfg


def flops(exp: Experiment, unroll: bool) -> float:
    """cost_analysis flops per device of the train step (tick loop unrolled if asked)."""
    model = exp.model
    if model.pipeline is not None and unroll:
        model = dataclasses.replace(model, pipeline=dataclasses.replace(model.pipeline, unroll=True))
    step = step_lib.make_train_step(model, exp.tx, exp.schedule, exp.layout, exp.mesh, exp.shardings,
                                    exp.grad_shardings, microbatches=1, seed=0)
    batch = jax.ShapeDtypeStruct(exp.batch_shape, jnp.int32, sharding=exp.batch_sharding)
    cost = step.lower(exp.abstract_state(), batch).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["flops"])


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--microbatches", default="4,8,16,32")
    ap.add_argument("--repeats", default="1,2")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args(argv)
    s = args.stages
    one = jax.devices()[:1]

    def unpipelined(layers):
        exp = Experiment.build(make_config(layers, args.batch, "data:1", "dp"), devices=one)
        return flops(exp, unroll=False)
    u_full, u_half = unpipelined(args.layers), unpipelined(args.layers // 2)
    u_nonblock = u_full - 2 * (u_full - u_half)
    print(f"unpipelined step (1 device): {u_full:.4e} flops, {1 - u_nonblock / u_full:.1%} of them "
          f"in the {args.layers} layers", flush=True)

    header = ("| S | r | M | ticks | formula (S-1)/(rM+S-1) | measured bubble | microbatching cost | "
              "peak MiB/device | collective-permute | all-reduce | all-gather | compile s |")
    rows = [header, "|---" * (header.count("|") - 1) + "|"]
    for r in (int(x) for x in args.repeats.split(",")):
        for m in (int(x) for x in args.microbatches.split(",")):
            t0 = time.perf_counter()
            one_stage = Experiment.build(make_config(args.layers, args.batch, "data:1", "dp_pp", m, r),
                                         devices=one)
            u_m = flops(one_stage, unroll=True)
            exp = Experiment.build(make_config(args.layers, args.batch, f"stage:{s}", "dp_pp", m, r),
                                   devices=jax.devices()[:s])
            pipe = exp.model.pipeline
            executed = flops(exp, unroll=True) * s
            compiled = exp.compile()
            peak = reporting.memory_report(compiled)["peak_estimate"] / 2**20
            coll = hlo.collectives(compiled)
            measured = (executed - u_m) / (executed - u_nonblock)

            def fmt(kind):
                c = coll[kind]
                return f"{c.count} x, {c.bytes / 2**20:.2f} MiB" if c.count else "0"
            rows.append(f"| {s} | {r} | {m} | {pipe.ticks} | {pipe.bubble:.1%} | {measured:.1%} | "
                        f"{u_m / u_full - 1:+.1%} | {peak:.1f} | {fmt('collective-permute')} | "
                        f"{fmt('all-reduce')} | {fmt('all-gather')} | {time.perf_counter() - t0:.0f} |")
            print(rows[-1], flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main(sys.argv[1:])
