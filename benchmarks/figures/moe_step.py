"""Reproduces docs/models.md, "Mixtures of experts: Mixtral" (the grouped matmul's CPU timings), and docs/benchmarks.md, "Mixtures of experts against their dense twin".

python benchmarks/figures/moe_step.py [--pairs 10] [--warmup 2] [--configs a,b,...] [--config.key=value ...]

A mixture of experts' train step against its dense twin, in one process on the same
simulated devices: for each Mixtral tiny layout, dropless and capacity 1.25, the compiled
matmul FLOPs over the model's (planner/hlo_flops.py; a conditional counts its costliest
branch, so a skipped branch still counts) and the median, over alternated rounds, of its
step time over the dense twin's (Llama tiny with mlp_dim = k x the experts' mlp, on
data:8). Only ratios taken in one process mean anything on simulated devices.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

from meshtrain import cli  # noqa: E402
from meshtrain.planner import hlo_flops  # noqa: E402
from meshtrain.run.experiment import Experiment  # noqa: E402
from meshtrain.runlog import metrics

TWIN = ("dense twin", "llama_tiny_dp8", ["--config.model.mlp_dim=256"])
CONFIGS = ("mixtral_tiny_dp8", "mixtral_tiny_dp2_ep4", "mixtral_tiny_dp2_ep2_tp2", "mixtral_tiny_fsdp2_ep4")


def build(name: str, overrides: list[str]):
    others, pairs = cli.split_overrides(overrides)
    if others:
        sys.exit(f"benchmarks/figures/moe_step.py: unknown flags {' '.join(others)}; overrides are --config.key=value")
    exp = Experiment.build(cli.load_config(name, pairs, "benchmarks/figures/moe_step.py"))
    state = exp.init_state()
    batch = exp.put_batch(next(exp.train_batches()))
    compiled = exp.train_step.lower(state, batch).compile()
    model_flops = metrics.flops_per_token(exp.model.cfg) * exp.batch_shape[0] * exp.model.cfg.seq_len
    return {"exp": exp, "state": state, "batch": batch, "step": compiled,
            "flops_ratio": hlo_flops.dot_flops(compiled.as_text()) * exp.mesh.size / model_flops}


def step_seconds(run) -> float:
    t0 = time.perf_counter()
    run["state"], out = run["step"](run["state"], run["batch"])
    jax.block_until_ready((run["state"], out))
    return time.perf_counter() - t0


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    args, rest = ap.parse_known_args(argv)
    runs = [TWIN]
    for name in args.configs.split(","):
        runs += [(f"{name} dropless", name, ["--config.moe.dispatch=dropless"]),
                 (f"{name} capacity 1.25", name, ["--config.moe.dispatch=capacity",
                                                  "--config.moe.capacity_factor=1.25"])]
    built = {label: build(name, [*extra, *rest]) for label, name, extra in runs}
    for run in built.values():
        for _ in range(args.warmup):
            step_seconds(run)
    times = {label: [] for label in built}
    for _ in range(args.pairs):  # rounds: every run once, so load drifts hit all alike
        for label, run in built.items():
            times[label].append(step_seconds(run))
    twin = times[TWIN[0]]
    print(f"{'run':<40} {'compiled/model FLOPs':>20} {'step ms':>9} {'step / twin':>12}")
    for label, run in built.items():
        ratio = statistics.median(t / d for t, d in zip(times[label], twin))
        print(f"{label:<40} {run['flops_ratio']:>20.3f} {1e3 * statistics.median(times[label]):>9.1f} "
              f"{ratio:>12.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
