"""Reproduces docs/benchmarks.md, "Mixtures of experts against their dense twin".

python benchmarks/figures/moe_loss.py [--steps 300] [--dir DIR] [--config.key=value ...]

Mixtral tiny trained on the synthetic data with dropless and with capacity dispatch (at
moe.capacity_factor 1.0 and 1.25), beside Llama tiny of equal active parameters (its
mlp_dim = k x the experts' mlp: 2 x 128 = 256; the MoE adds only its router, D X = 256 a
layer). Each run is `meshtrain train` as a user runs it, on the same data, seed and
schedule; the table gives each one's last train loss, eval loss, the router's statistics
and its step time (simulated CPU devices: step times compare the runs with each other
only).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile

RUNS = [
    ("dense llama, mlp 256", "llama_tiny_dp8", ["--config.model.mlp_dim=256"]),
    ("mixtral dropless", "mixtral_tiny_dp8", []),
    ("mixtral capacity 1.25", "mixtral_tiny_dp8", ["--config.moe.dispatch=capacity", "--config.moe.capacity_factor=1.25"]),
    ("mixtral capacity 1.0", "mixtral_tiny_dp8", ["--config.moe.dispatch=capacity", "--config.moe.capacity_factor=1.0"]),
]


def last_rows(path: pathlib.Path) -> tuple[dict, dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r]
    return train[-1], (evals[-1] if evals else {})


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--dir", default=None, help="where the runs' workdirs go (default: a temporary dir)")
    args, overrides = p.parse_known_args()
    root = pathlib.Path(args.dir or tempfile.mkdtemp(prefix="moe_loss_"))
    results = []
    for label, config, extra in RUNS:
        workdir = root / label.replace(" ", "_").replace(",", "")
        cmd = [sys.executable, "-m", "meshtrain.train", f"--config={config}", f"--workdir={workdir}",
               f"--config.train.steps={args.steps}", "--config.checkpoint.every=0", *extra, *overrides]
        print("$", " ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        results.append((label, *last_rows(workdir / "metrics.jsonl")))
    print(f"\n{args.steps} steps on the synthetic data (best possible loss: the data's entropy rate)\n")
    print("A train row's loss includes the router's auxiliary loss; `train CE` leaves it out.\n")
    print("| run | train CE | eval loss | load balance | z-loss | dropped | ms/step |")
    print("|---|---|---|---|---|---|---|")
    for label, train, ev in results:
        moe = [train.get(k) for k in ("moe_load_balance", "moe_z_loss", "moe_dropped")]
        cells = ["" if v is None else f"{v:.4g}" for v in moe]
        ce = train["loss"] - train.get("moe_aux_loss", 0.0)
        print(f"| {label} | {ce:.4f} | {ev.get('eval_loss', float('nan')):.4f} | "
              f"{' | '.join(cells)} | {1e3 * train['step_time_s']:.1f} |")


if __name__ == "__main__":
    main()
