"""Reproduces docs/benchmarks.md, "Pipeline bubble, memory and communication"; docs/benchmarks.md, "Pipeline schedules side by side".

python benchmarks/figures/pipeline.py [--stages 4] [--microbatches 4,8,16,32] [--repeats 1,2]
                                [--layers 8] [--batch 64] [--no_cost_analysis]
python benchmarks/figures/pipeline.py --schedules [--pairs 10]     # gpt2_tiny, the five schedules timed
python benchmarks/figures/pipeline.py --schedules --compile_only   # + gpt2_medium and Llama 3 8B, 32 devices

`--schedules` compares gpipe, circular, 1f1b, interleaved and zb side by side, each 1F1B
schedule with both stashes (docs/pipeline.md): compiled peak memory and temp memory per
device, matmul FLOPs per device (loop trip counts included), the idle share of the
ticks from the tick tables, and the step time relative to gpipe, timed in alternating
pairs in one process. `--compile_only` adds the compiled figures (no timing) of
gpt2_medium_dp2_pp4_tp4 and llama3_8b_pp4_fsdp2_tp4 on 32 simulated devices.

The pipeline bubble, memory and communication, read from compiled programs (no timing).

In the SPMD form every stage computes on every tick, so the bubble is not idle time
but wasted FLOPs: a stage computes on zeros while it waits. For each (M, r) this
compiles the train step of a GPT-2 tiny with `--layers` layers on a `stage:S` mesh
of fake CPU devices and compares the work all S devices execute with the useful work:

    formula            (S - 1) / (r*M + S - 1)
    matmul bubble      (E - U) / (E - U_head)   from matmul FLOPs (meshtrain.planner.hlo_flops.dot_flops,
                       loop trip counts included): E = per-device x S, pipelined;
                       U = one-stage program, same M and r (no bubble); U_head = the
                       matmuls outside the layers (unpipelined step at L and L/2 layers)
    cost_analysis      the same from `compiled.cost_analysis()["flops"]`, with the tick
                       loop and the layers unrolled (cost_analysis counts a while body
                       once), so element-wise work counts too

Element-wise FLOP counts move by a few percent with XLA's fusion choices, which depend
on the shapes: the one-stage program with M microbatches already costs several percent
more than the unpipelined step (column "microbatching cost"), with no stage at all.
The matmul count has no such noise, and it is the work that takes the time.

It also reports, from the normal (rolled) program, the per-device peak memory
estimate (temp + arguments + outputs - aliased) and the collectives per step by
kind (meshtrain.planner.hlo.collectives, loop trip counts included). Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time

import jax

# 32 devices for the compile-only configs; the rest use the first 8 or fewer.
jax.config.update("jax_num_cpu_devices", 32 if "--compile_only" in sys.argv else 8)

import jax.numpy as jnp  # noqa: E402

from meshtrain import config as config_lib, mesh as mesh_lib  # noqa: E402
from meshtrain.planner import hlo, hlo_flops  # noqa: E402
from meshtrain.run.experiment import Experiment  # noqa: E402
from meshtrain.runlog import metrics  # noqa: E402
from meshtrain.step import train_step as step_lib  # noqa: E402


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
                                    exp.grad_shardings)
    batch = jax.ShapeDtypeStruct(exp.batch_shape, jnp.int32, sharding=exp.batch_sharding)
    cost = step.lower(exp.abstract_state(), batch).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["flops"])


SCHEDULES = {  # label: overrides (on top of the config's own)
    "gpipe": {"pipeline.schedule": "gpipe", "pipeline.repeats": 1},
    "circular r=2": {"pipeline.schedule": "circular", "pipeline.repeats": 2},
    "1f1b, stash inputs": {"pipeline.schedule": "1f1b", "pipeline.repeats": 1, "pipeline.stash": "inputs"},
    "1f1b, stash residuals": {"pipeline.schedule": "1f1b", "pipeline.repeats": 1, "pipeline.stash": "residuals"},
    "interleaved r=2, inputs": {"pipeline.schedule": "interleaved", "pipeline.repeats": 2, "pipeline.stash": "inputs"},
    "interleaved r=2, residuals": {"pipeline.schedule": "interleaved", "pipeline.repeats": 2,
                                   "pipeline.stash": "residuals"},
    "zb, stash inputs": {"pipeline.schedule": "zb", "pipeline.repeats": 1, "pipeline.stash": "inputs"},
    "zb, stash residuals": {"pipeline.schedule": "zb", "pipeline.repeats": 1, "pipeline.stash": "residuals"},
    "zb r=2, residuals": {"pipeline.schedule": "zb", "pipeline.repeats": 2, "pipeline.stash": "residuals"},
}


def schedule_rows(name: str, base: dict, labels, time_pairs: int = 0) -> list[str]:
    """One markdown row per schedule of config `name`: memory, FLOPs, idle share, and the
    step time over gpipe's (alternating pairs of steps, `time_pairs` of them)."""
    from meshtrain.parallel.pipeline import ticks as pipeline_ticks
    built, rows = {}, []
    for label in labels:
        cfg = config_lib.load(name)
        for key, value in {**base, **SCHEDULES[label]}.items():
            config_lib.override(cfg, key, str(value))
        needed = math.prod(mesh_lib.parse_shape(cfg.mesh.shape).values())
        exp = Experiment.build(cfg, devices=jax.devices()[:needed])
        t0 = time.perf_counter()
        compiled = exp.compile()
        compile_s = time.perf_counter() - t0
        mem = metrics.memory_report(compiled)
        pipe = exp.model.pipeline
        kept = (f"{pipeline_ticks.in_flight(pipe)[0]} of {pipe.repeats * pipe.microbatches} items"
                if pipe.one_f_one_b else f"{pipe.microbatches} of {pipe.microbatches}")
        built[label] = exp
        rows.append([label, f"{pipe.bubble:.1%}", kept, f"{mem['temp'] / 2**20:,.1f}",
                     f"{mem['peak_estimate'] / 2**20:,.1f}", f"{hlo_flops.dot_flops(compiled) / 1e9:,.2f}",
                     f"{compile_s:.0f} s"])
        print(" | ".join(rows[-1]), flush=True)
    times = {label: [] for label in labels}
    if time_pairs:
        runs = {}
        for label, exp in built.items():
            state, batch = exp.init_state(), exp.put_batch(next(exp.train_batches()))
            for _ in range(2):  # compile and warm up
                state, out = exp.train_step(state, batch)
            jax.block_until_ready(out)
            runs[label] = [exp.train_step, state, batch]
        for _ in range(time_pairs):
            for label, run in runs.items():
                t0 = time.perf_counter()
                run[1], out = run[0](run[1], run[2])
                jax.block_until_ready(out)
                times[label].append(time.perf_counter() - t0)
    base_time = sorted(times[labels[0]])[len(times[labels[0]]) // 2] if time_pairs else 0
    out = []
    for row, label in zip(rows, labels):
        ratio = f"{sorted(times[label])[len(times[label]) // 2] / base_time:.2f}" if time_pairs else "-"
        out.append("| " + " | ".join(row + [ratio]) + " |")
    return out


def compare_schedules(args) -> None:
    header = ("| schedule | idle share of ticks | kept by stage 0 | temp MiB/device | peak MiB/device | "
              "matmul GFLOP/device | compile | step time / gpipe |")
    rule = "|---" * (header.count("|") - 1) + "|"
    print("gpt2_tiny_pp4_dp2, 8 layers, M=16, batch 64 (8 devices: data:2, stage:4)")
    rows = schedule_rows("gpt2_tiny_pp4_dp2", {"model.num_layers": 8, "pipeline.microbatches": 16,
                                               "train.batch_size": 64}, list(SCHEDULES), args.pairs)
    print("\n".join([header, rule, *rows]), flush=True)
    if args.compile_only:
        labels = ["gpipe", "1f1b, stash inputs", "1f1b, stash residuals", "zb, stash residuals"]
        for name, base in (("gpt2_medium_dp2_pp4_tp4", {}), ("llama3_8b_pp4_fsdp2_tp4", {})):
            print(f"{name} (32 devices, compile only)")
            print("\n".join([header, rule, *schedule_rows(name, base, labels)]), flush=True)


def main(argv: list[str]) -> None:
    if "--schedules" in argv:
        ap = argparse.ArgumentParser()
        ap.add_argument("--schedules", action="store_true")
        ap.add_argument("--pairs", type=int, default=10, help="timed steps per schedule, alternating")
        ap.add_argument("--compile_only", action="store_true")
        return compare_schedules(ap.parse_args(argv))
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--microbatches", default="4,8,16,32")
    ap.add_argument("--repeats", default="1,2")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--no_cost_analysis", action="store_true",
                    help="skip the unrolled compiles (minutes each at M=32): matmul, memory and "
                         "collective columns only")
    args = ap.parse_args(argv)
    s = args.stages
    one = jax.devices()[:1]

    def unpipelined(layers):
        exp = Experiment.build(make_config(layers, args.batch, "data:1", "dp"), devices=one)
        return hlo_flops.dot_flops(exp.compile()), flops(exp, unroll=False)
    (d_full, c_full), (d_half, c_half) = unpipelined(args.layers), unpipelined(args.layers // 2)
    d_head, c_head = d_full - 2 * (d_full - d_half), c_full - 2 * (c_full - c_half)
    print(f"unpipelined step (1 device): {d_full:.4e} matmul flops, {1 - d_head / d_full:.1%} of "
          f"them in the {args.layers} layers; cost_analysis {c_full:.4e}", flush=True)

    header = ("| S | r | M | ticks | formula (S-1)/(rM+S-1) | matmul bubble | cost_analysis bubble | "
              "microbatching cost | peak MiB/device | collective-permute | all-reduce | all-gather |")
    rows = [header, "|---" * (header.count("|") - 1) + "|"]
    for r in (int(x) for x in args.repeats.split(",")):
        for m in (int(x) for x in args.microbatches.split(",")):
            one_stage = Experiment.build(make_config(args.layers, args.batch, "data:1", "dp_pp", m, r),
                                         devices=one)
            exp = Experiment.build(make_config(args.layers, args.batch, f"stage:{s}", "dp_pp", m, r),
                                   devices=jax.devices()[:s])
            compiled = exp.compile()
            d_exec, d_useful = hlo_flops.dot_flops(compiled) * s, hlo_flops.dot_flops(one_stage.compile())
            c_exec, c_useful = ((float("nan"),) * 2 if args.no_cost_analysis else
                                (flops(exp, unroll=True) * s, flops(one_stage, unroll=True)))
            peak = metrics.memory_report(compiled)["peak_estimate"] / 2**20
            coll = hlo.collectives(compiled)

            def fmt(kind):
                c = coll[kind]
                return f"{c.count} x, {c.bytes / 2**20:.2f} MiB" if c.count else "0"
            rows.append(
                f"| {s} | {r} | {m} | {exp.model.pipeline.ticks} | {exp.model.pipeline.bubble:.1%} | "
                f"{(d_exec - d_useful) / (d_exec - d_head):.1%} | "
                f"{(c_exec - c_useful) / (c_exec - c_head):.1%} | {c_useful / c_full - 1:+.1%} | "
                f"{peak:.1f} | {fmt('collective-permute')} | {fmt('all-reduce')} | {fmt('all-gather')} |")
            print(rows[-1], flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main(sys.argv[1:])
