"""python benchmarks/gpu.py [--models gpt2_small,gpt2_medium,llama3_1b] [--remat none,save_dots,full]
                           [--steps 50] [--repeats 3] [--warmup 10] [--max-batch 64]
                           [--overhead-pairs 50] [--out FILE.json] [--profile DIR] [--docs]
                           [--config.key=value ...]

Training throughput on one GPU (H100, H200): for each model and remat policy, the largest
batch that fits (from --max-batch down, halving: first by the compiled memory estimate
against the allocator's limit, then by running it and stepping down on RESOURCE_EXHAUSTED;
policies run full, save_dots, none, each starting from the batch the one before chose),
then warm-up and 3 x 50 timed steps. It reports tokens/s, MFU in the llm.c and the PaLM
conventions (benchmarks/gpu_runs.py), the step-time spread, peak device memory
(`memory_stats()`) beside the compiled estimate, compile time, the attention kernel used,
the device and the versions; then the best remat policy per model, and
benchmarks/overhead.py's meshtrain-vs-bare-JAX comparison for GPT-2 small on the GPU.

Writes FILE.json (default benchmarks/results/gpu-<device>.json; runs of another invocation
on the same device kind are kept, so models can be measured one command at a time), prints
the table, and with --docs rewrites the GPU table in docs/benchmarks.md. `--render` only
re-renders FILE.json. Each run is a child process, so the peak memory is its own.

Every GPU run uses meshtrain's XLA GPU flags (meshtrain/xla_flags.py, docs/xla_flags.md),
as training does. `--allow-cpu` runs the same path on CPU (for the tests, with gpt2_tiny);
without it a machine with no GPU gets a one-line error and exit status 2.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))  # meshtrain from this checkout, when not installed

from meshtrain import xla_flags  # noqa: E402  (imports no JAX: XLA_FLAGS is set before it starts)

import gpu_report  # noqa: E402
from gpu_runs import MODELS  # noqa: E402  (imports JAX, which starts no backend until used)

DEFAULT_MODELS = "gpt2_small,gpt2_medium,llama3_1b"
REMATS = ("none", "save_dots", "full")
# Run from the least activation memory up: a policy that keeps more never fits a larger
# batch, so each starts its search at the batch the one before it chose.
BY_MEMORY = ("full", "save_dots", "none")
OVERHEAD_CONFIG = {"gpt2_small": "gpt2_small_dp8", "gpt2_tiny": "gpt2_tiny_dp8"}  # mesh overridden to data:1


def parse(argv: list[str]):
    ap = argparse.ArgumentParser(description="Training throughput on one GPU.")
    ap.add_argument("--models", default=DEFAULT_MODELS)
    ap.add_argument("--remat", default=",".join(REMATS), help="comma-separated remat policies to sweep")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--max-batch", type=int, default=64, help="rows per step to try first")
    ap.add_argument("--overhead-pairs", type=int, default=50, help="0 skips the bare-JAX comparison")
    ap.add_argument("--mem-fraction", default="0.90",
                    help="XLA_PYTHON_CLIENT_MEM_FRACTION for the runs, unless already set")
    ap.add_argument("--out", help="results JSON (default benchmarks/results/gpu-<device>.json)")
    ap.add_argument("--profile", metavar="DIR", help="after timing each run, trace 3 more steps into "
                    "DIR/MODEL-REMAT (benchmarks/trace_summary.py sums a trace by kernel)")
    ap.add_argument("--docs", action="store_true", help="rewrite the GPU table in docs/benchmarks.md")
    ap.add_argument("--render", action="store_true", help="no runs: render --out's JSON")
    ap.add_argument("--allow-cpu", action="store_true", help="run on CPU too (the tests' smoke run)")
    ap.add_argument("--child", choices=("probe", "run"), help=argparse.SUPPRESS)
    ap.add_argument("--child-args", default="{}", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args, rest = ap.parse_known_args(argv)
    overrides = []
    for arg in rest:
        key, sep, value = arg[2:].partition("=")
        if not (arg.startswith("--config.") and sep):
            ap.error(f"unrecognised argument {arg!r}; overrides are --config.key=value")
        overrides.append((key[len("config."):], value))
    models = [m for m in args.models.split(",") if m]
    remats = [r for r in args.remat.split(",") if r]
    bad = [m for m in models if m not in MODELS] + [r for r in remats if r not in REMATS]
    if bad or not models or not remats:
        ap.error(f"--models from {', '.join(MODELS)} and --remat from {', '.join(REMATS)}; got {bad or 'none'}")
    if min(args.steps, args.repeats, args.warmup, args.max_batch) < 1:
        ap.error("--steps, --repeats, --warmup and --max-batch must be >= 1")
    return args, models, remats, overrides


def child(args, overrides) -> int:
    """Runs inside a child process: one probe or one (model, remat) run -> --result JSON."""
    import traceback

    import gpu_runs
    from meshtrain.errors import UserError
    try:
        if args.child == "probe":
            result = gpu_runs.probe()
        else:
            result = gpu_runs.run(**json.loads(args.child_args), overrides=overrides)
    except UserError as e:
        result = {"error": str(e)}
    except Exception as e:  # a bug: its traceback on stderr, one line in the results
        traceback.print_exc()
        result = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]}
    pathlib.Path(args.result).write_text(json.dumps(result, default=str))
    return 0


def spawn(mode: str, env: dict, argv_rest: list[str], **kwargs) -> dict:
    """Runs this script as a child in `mode`; its output goes to the terminal."""
    with tempfile.TemporaryDirectory() as tmp:
        result = pathlib.Path(tmp) / "result.json"
        cmd = [sys.executable, str(HERE / "gpu.py"), f"--child={mode}", f"--child-args={json.dumps(kwargs)}",
               f"--result={result}", *argv_rest]
        status = subprocess.run(cmd, env=env, cwd=ROOT).returncode
        if not result.exists():
            return {"error": f"the child process exited with status {status} and no result"}
        return json.loads(result.read_text())


def overhead(model: str, batch: int, pairs: int, warmup: int, env: dict, overrides) -> dict:
    """benchmarks/overhead.py on this device at `batch`, its RESULT lines parsed."""
    cmd = [sys.executable, str(HERE / "overhead.py"), "--config", OVERHEAD_CONFIG[model],
           "--config.mesh.shape=data:1", f"--config.train.batch_size={batch}",
           "--config.model.dtype=bfloat16", *(f"--config.{k}={v}" for k, v in overrides),
           "--devices", "1", "--pairs", str(pairs), "--warmup", str(warmup)]
    shown = "python benchmarks/overhead.py " + " ".join(cmd[2:])
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    print(out.stdout, end="", flush=True)
    ratio = re.search(r"median ratio meshtrain/bare = ([\d.]+) \(IQR ([\d.]+)-([\d.]+)\)", out.stdout)
    ms = re.search(r"meshtrain ([\d.]+) ms, bare ([\d.]+) ms", out.stdout)
    equal = re.search(r"(flops equal: \w+; collectives equal: \w+; opcodes equal: \w+)", out.stdout)
    if out.returncode or not (ratio and ms):
        tail = (out.stderr.strip().splitlines() or [f"exit status {out.returncode}"])[-1]
        return {"model": model, "command": shown, "batch": batch, "error": tail[:500]}
    return {"model": model, "command": shown, "batch": batch, "ratio": float(ratio[1]),
            "iqr": [float(ratio[2]), float(ratio[3])], "meshtrain_ms": float(ms[1]),
            "bare_ms": float(ms[2]), "equal": equal[1] if equal else "", "pairs": pairs}


def best_remat(runs: list[dict]) -> dict:
    """model -> the remat policy with the most tokens/s among those that ran."""
    best = {}
    for r in runs:
        if "error" not in r and r["tokens_per_s"] > best.get(r["model"], {}).get("tokens_per_s", 0):
            best[r["model"]] = r
    ran = {m: sorted(r["remat"] for r in runs if r["model"] == m and "error" not in r) for m in best}
    return {m: {"remat": r["remat"], "tokens_per_s": r["tokens_per_s"], "mfu_llmc": r["mfu"]["llmc"],
                "why": f"most tokens/s of {', '.join(ran[m])}, each at its largest batch that fits"}
            for m, r in best.items()}


def default_out(device_kind: str) -> pathlib.Path:
    return HERE / "results" / f"gpu-{re.sub(r'[^a-z0-9]+', '-', device_kind.lower()).strip('-')}.json"


def main(argv: list[str]) -> int:
    args, models, remats, overrides = parse(argv)
    passed = [f"--config.{k}={v}" for k, v in overrides]
    if args.child:
        return child(args, overrides)
    if args.render:
        if not args.out:
            sys.exit("benchmarks/gpu.py --render reads --out=FILE.json; give it.")
        results = json.loads(pathlib.Path(args.out).read_text())
        print("\n".join(gpu_report.runs_table(results) + [""] + gpu_report.goals_table(results)))
        if args.docs:
            gpu_report.rewrite_docs(results)
        return 0

    note = xla_flags.apply(os.environ)  # before any child starts a backend; they inherit it
    if note:
        print(note, flush=True)
    env = {**os.environ}
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", args.mem_fraction)
    device = spawn("probe", env, passed)
    if "error" in device:
        print(f"benchmarks/gpu.py: the device probe failed: {device['error']}", file=sys.stderr)
        return 1
    if device["platform"] != "gpu" and not args.allow_cpu:
        print(f"benchmarks/gpu.py needs a GPU; jax sees only {device['platform']} devices. Run it on a "
              f"GPU machine (docs/benchmarks.md), or pass --allow-cpu for the CPU smoke run the tests use.",
              file=sys.stderr)
        return 2
    out = pathlib.Path(args.out) if args.out else default_out(device["device_kind"])
    old = json.loads(out.read_text()) if out.exists() else {}
    if old.get("device", {}).get("device_kind") != device["device_kind"]:
        old = {}  # timings from another device kind do not mix
    now = {(m, r) for m in models for r in remats}
    runs = [r for r in old.get("runs", []) if (r["model"], r["remat"]) not in now]
    for model in models:
        cap = args.max_batch
        for remat in (r for r in BY_MEMORY if r in remats):
            print(f"== {model}, remat {remat}, batch {cap} or less", flush=True)
            runs.append(spawn("run", env, passed, model=model, remat=remat, cap=cap,
                              steps=args.steps, repeats=args.repeats, warmup=args.warmup,
                              profile=args.profile and str(pathlib.Path(args.profile).resolve())))
            cap = runs[-1].get("batch", cap)
    runs.sort(key=lambda r: (list(MODELS).index(r["model"]), REMATS.index(r["remat"])))
    results = {
        "benchmark": "benchmarks/gpu.py", "command": "python benchmarks/gpu.py " + " ".join(argv),
        "date": datetime.date.today().isoformat(), "device": device,
        "xla_flags": {"XLA_FLAGS": os.environ.get("XLA_FLAGS", ""), "note": note},
        "settings": {"steps": args.steps, "repeats": args.repeats, "warmup": args.warmup,
                     "max_batch": args.max_batch, "overrides": overrides,
                     "XLA_PYTHON_CLIENT_MEM_FRACTION": env["XLA_PYTHON_CLIENT_MEM_FRACTION"]},
        "runs": runs, "best_remat": best_remat(runs), "overhead": old.get("overhead"),
    }
    base = next((r for r in runs if r["model"] in OVERHEAD_CONFIG and r["remat"] == "none"
                 and "error" not in r and r["model"] in models), None)
    if args.overhead_pairs and base:
        print(f"== bare-JAX comparison, {base['model']} at batch {base['batch']}", flush=True)
        results["overhead"] = overhead(base["model"], base["batch"], args.overhead_pairs,
                                       min(args.warmup, 10), env, overrides)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print("\n".join(["", *gpu_report.runs_table(results), "", *gpu_report.goals_table(results), "",
                     f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}"]))
    if args.docs:
        gpu_report.rewrite_docs(results)
        print("rewrote the GPU table in docs/benchmarks.md")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
