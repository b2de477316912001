"""python benchmarks/planner_calibration.py [--results 'benchmarks/results/gpu-*.json'] [--json]
python benchmarks/planner_calibration.py --predict [--models M,..] [--hardware h100,h200] [--out FILE]

The planner's step time against every measured GPU run: each run of benchmarks/gpu.py in
the results files is rebuilt with its own settings (benchmarks/gpu_runs.make_config:
model, remat, batch, one device, bf16 compute), planned for the hardware entry of the
card it ran on, exactly as `meshtrain plan --hardware=...` does, and set beside the
measured median step. Which runs calibrated the table (planner/hardware.py) and which are
held out is said per row.

`--predict` plans the runs a GPU session will measure before it measures them (each model
and remat at the largest batch from 64 down, halving, whose formulas fit the card, as
benchmarks/gpu.py searches by the compiled estimate) and writes them, with the commit and
the date, to benchmarks/results/predictions.json, to be committed before the session. The
batch 64 start is 32 for the MoE models, as gpu_session.sh's moe stage runs them.

Run on CPU (one simulated device; the planner compiles for shapes only).
"""

from __future__ import annotations

import argparse
import glob
import json
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

# The runs hardware.py's measured figures came from; every other run is held out.
CALIBRATED_ON = {("gpt2_small", "none", "h200"): "matmul, attention, idle, memory share (profile)",
                 ("gpt2_small", "none", "h100"): "memory share",
                 ("gpt2_small", "full", "h200"): "LAYER_PASSES[full]"}
REMATS = ("none", "save_dots", "full")
KINDS = {"NVIDIA H200": "h200", "NVIDIA H100 80GB HBM3": "h100"}


def hardware_for(device_kind: str) -> str | None:
    return KINDS.get(device_kind) or next((v for k, v in KINDS.items() if device_kind.startswith(k)), None)


def measured_runs(pattern: str = str(HERE / "results" / "gpu-*.json")):
    """Yields (hardware entry, run, its results file's dict) for every run with a measured
    step in the results files of a card the hardware table has."""
    for path in sorted(glob.glob(pattern)):
        results = json.loads(pathlib.Path(path).read_text())
        hw_name = hardware_for(results["device"]["device_kind"])
        for r in results["runs"]:
            if hw_name is not None and "step_s_median" in r:
                yield hw_name, r, {**results, "path": path}


def rows(pattern: str):
    import jax
    import gpu_runs
    from meshtrain.planner import hardware, report
    from meshtrain.run.experiment import Experiment
    for hw_name, r, results in measured_runs(pattern):
        exp = Experiment.build(gpu_runs.make_config(r["model"], r["remat"], r["batch"]), devices=jax.devices()[:1])
        p = report.plan(exp, hardware.get(hw_name))["prediction"]
        measured = r["step_s_median"]
        key = (r["model"], r["remat"], hw_name)
        yield {"model": r["model"], "remat": r["remat"], "hardware": hw_name, "batch": r["batch"],
               "seq_len": r["seq_len"], "measured_ms": 1e3 * measured, "predicted_ms": 1e3 * p["step_time_s"],
               "ratio": p["step_time_s"] / measured,
               "terms_ms": {k: 1e3 * p[k] for k in ("matmul_s", "attention_s", "memory_s", "idle_s")},
               "role": (f"calibration: {CALIBRATED_ON[key]}" if key in CALIBRATED_ON
                        else "held out"),
               "results": pathlib.Path(results["path"]).name, "date": results.get("date")}


PREDICT = "gpt2_small:none,gpt2_small:full,gpt2_medium:none,llama3_1b:none,llama3_1b:full," \
          "moe_small_dropless:none,moe_small_capacity:none,moe_small_dense_twin:none"


def predictions(runs: list[tuple[str, str]], cards: list[str]) -> list[dict]:
    """Each (model, remat) on each card at the largest batch from its cap down (64; 32 for
    the MoE models, as gpu_session.sh's moe stage) whose formula total fits: the planner's
    step, MFU and terms."""
    import jax
    import gpu_runs
    from meshtrain.planner import hardware, report
    from meshtrain.run.experiment import Experiment
    out = []
    for model, remat in runs:
        for card in cards:
            hw, batch = hardware.get(card), 32 if model.startswith("moe_") else 64
            while True:
                exp = Experiment.build(gpu_runs.make_config(model, remat, batch), devices=jax.devices()[:1])
                r = report.plan(exp, hw)
                if r["fits"]["fits"] or batch == 1:
                    break
                batch //= 2
            p = r["prediction"]
            tokens = exp.units_per_step
            out.append({"model": model, "remat": remat, "hardware": card, "batch": batch,
                        "seq_len": exp.model.cfg.seq_len, "fits": r["fits"]["fits"],
                        "predicted_ms": 1e3 * p["step_time_s"], "predicted_tokens_per_s": tokens / p["step_time_s"],
                        "predicted_mfu_llmc": p["mfu"],
                        "terms_ms": {k: 1e3 * p[k] for k in ("matmul_s", "attention_s", "memory_s", "idle_s")},
                        "memory_gib": r["fits"]["analytic_total_bytes"] / 2**30})
            print(f"{model} remat {remat} on {card}: batch {batch} x {exp.model.cfg.seq_len}, "
                  f"{out[-1]['predicted_ms']:.1f} ms, MFU {100 * p['mfu']:.1f}%", flush=True)
    return out


def commit() -> str:
    import subprocess
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description="The planner's step time against the measured GPU runs.")
    ap.add_argument("--results", default=str(HERE / "results" / "gpu-*.json"))
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--predict", action="store_true", help="plan the next GPU session's runs and write them")
    ap.add_argument("--runs", default=PREDICT, help="MODEL:REMAT,... for --predict")
    ap.add_argument("--hardware", default="h100,h200", help="cards for --predict")
    ap.add_argument("--out", default=str(HERE / "results" / "predictions.json"))
    args = ap.parse_args()
    if args.predict:
        import datetime
        from gpu_runs import MODELS
        runs = [tuple(item.split(":")) for item in args.runs.split(",") if item]
        bad = [":".join(r) for r in runs if len(r) != 2 or r[0] not in MODELS or r[1] not in REMATS]
        if bad or not runs:
            ap.error(f"--runs takes MODEL:REMAT,... with MODEL from {', '.join(MODELS)} and REMAT from "
                     f"{', '.join(REMATS)}; got {', '.join(bad) or 'none'}")
        rows_ = predictions(runs, [c for c in args.hardware.split(",") if c])
        pathlib.Path(args.out).write_text(json.dumps(
            {"made_by": "python benchmarks/planner_calibration.py --predict", "commit": commit(),
             "date": datetime.date.today().isoformat(), "predictions": rows_}, indent=1) + "\n")
        print(f"wrote {args.out}")
        return
    out = list(rows(args.results))
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print("| run | card | batch x T | measured ms | predicted ms | predicted / measured | "
          "matmul + attention + memory + idle ms | role |")
    print("|---|---|---|---|---|---|---|---|")
    for r in out:
        t = r["terms_ms"]
        print(f"| {r['model']}, remat {r['remat']} | {r['hardware']} | {r['batch']} x {r['seq_len']} | {r['measured_ms']:.1f} | "
              f"{r['predicted_ms']:.1f} | {r['ratio']:.2f} | {t['matmul_s']:.1f} + {t['attention_s']:.1f} + "
              f"{t['memory_s']:.1f} + {t['idle_s']:.1f} | {r['role']} |")


if __name__ == "__main__":
    main()
