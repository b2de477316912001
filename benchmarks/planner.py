"""How close the planner's formulas come to the compiled programs (docs/planner.md).

    python benchmarks/planner.py [--out=FILE.json]

For GPT-2 small (124M) and Llama 3.2 1B on 8 simulated CPU devices, under dp8, fsdp8,
zero1, dp2_tp4 and pp2_dp4 (4 pipeline microbatches), in float32 and bfloat16 compute,
at 16 rows x 1024 tokens per step: compiled vs formula memory per device (params,
optimizer, activations) and collective bytes against their lower bound. Prints a
markdown table; `--out` also writes every report as JSON.
"""

from __future__ import annotations

import argparse
import json

import jax

from meshtrain.planner import fast_compile

fast_compile()  # before JAX starts: the same figures, compiled 2-3x faster
jax.config.update("jax_num_cpu_devices", 8)

from meshtrain import config as config_lib  # noqa: E402
from meshtrain.planner import hardware, report  # noqa: E402
from meshtrain.run.experiment import Experiment  # noqa: E402

MODELS = {"gpt2_small": ("gpt2_small_dp8", {"model.seq_len": "1024"}),
          "llama3_1b": ("llama3_1b_fsdp8", {"model.seq_len": "1024"})}
LAYOUTS = {"dp8": ("data:8", "dp", 0), "fsdp8": ("fsdp:8", "fsdp", 0), "zero1": ("data:8", "zero1", 0),
           "dp2_tp4": ("data:2,tensor:4", "dp_tp", 0), "pp2_dp4": ("data:4,stage:2", "dp_pp", 4)}


def measure(model: str, layout: str, dtype: str) -> dict:
    name, extra = MODELS[model]
    mesh, preset, micro = LAYOUTS[layout]
    overrides = {**extra, "mesh.shape": mesh, "mesh.dcn": "", "layout": preset, "pipeline.microbatches": micro,
                 "train.batch_size": 16, "train.grad_accum_steps": 1, "model.dtype": dtype, "model.remat": "none"}
    r = report.plan(Experiment.build(config_lib.load(name, overrides.items())), hardware.get("h100"))
    r.pop("config")
    return {**r, "model": model, "layout": layout, "dtype": dtype}


def row(r: dict) -> str:
    mem, formula = r["memory_per_device_bytes"], r["analytic_memory_per_device_bytes"]
    bound = r["collective_lower_bound_bytes"]
    axes = "; ".join(f"{'+'.join(a['mesh_axes'])} {a['ratio']:.2f}x" for a in r["collectives_by_axes"]
                     if a["ratio"] is not None)
    return (f"| {r['model']} | {r['layout']} | {r['dtype']} | {mem['params'] / 2**20:,.1f} / "
            f"{formula['params'] / 2**20:,.1f} | {mem['optimizer'] / 2**20:,.1f} / {formula['optimizer'] / 2**20:,.1f} "
            f"| {mem['activations'] / 2**20:,.0f} / {formula['activations'] / 2**20:,.0f} "
            f"({mem['activations'] / formula['activations']:.2f}x) | "
            f"{r['collective_bytes_per_step'] / 2**20:,.1f} / {bound / 2**20:,.1f} "
            f"({r['collective_bytes_per_step'] / bound if bound else float('nan'):.2f}x) | {axes} |")


def main() -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/planner.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", metavar="FILE.json", help="also write every report as JSON")
    out = p.parse_args().out
    print("| model | layout | compute | params MiB compiled / formula | optimizer MiB | activations MiB "
          "(ratio) | collectives MiB sent / bound (ratio) | per axes |")
    print("|---|---|---|---|---|---|---|---|")
    reports = []
    for model in MODELS:
        for layout in LAYOUTS:
            for dtype in ("float32", "bfloat16"):
                r = measure(model, layout, dtype)
                reports.append(r)
                print(row(r), flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(reports, f, indent=1, default=str)


if __name__ == "__main__":
    main()
