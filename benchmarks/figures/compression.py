"""Reproduces docs/performance.md, "Gradients over slow links": convergence of each
train.grad_compression setting against the float32 reduction.

python benchmarks/figures/compression.py --text=FILE [--config gpt2_tiny_dp8] [--steps 300]
                                         [--workdir runs/compression] [--out FIGURE] [--seeds 0,1,2]

Trains the config with mesh.dcn=data:2 (two simulated nodes) once per setting: the
reduction XLA writes (float32 here), int8, onebit with error feedback and onebit without;
without clipping, float32 and onebit on the gradient and on the momentum
(train.compress_momentum, 100 exact steps first), each with feedback and without; and
DiLoCo with a round of 8 steps (diloco.every=8, the two nodes its islands),
same seed and data (data.kind=text on FILE: any text corpus; the docs' figure used the
fortune files of Debian's `fortunes` and `fortunes-min` packages, 2.5 MB of English, the
ascii-art files left out), evaluating 12 times on the held-out tail. Prints each run's
final train and eval loss against the float32 run's (without clipping: float32-noclip's), and draws the curves with
`meshtrain compare` (--out). With several --seeds (train.seed: the init and the data
order) each setting trains once a seed, and the table gives the mean and the range of its
eval loss, so that a difference between settings can be read against the one between seeds.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

SETTINGS = {  # label -> overrides
    "float32": {},
    "int8": {"train.grad_compression": "int8"},
    "onebit": {"train.grad_compression": "onebit"},
    "onebit-no-feedback": {"train.grad_compression": "onebit", "train.error_feedback": "false"},
    # Without clipping (optim.grad_clip would clip the gradient recovered from a compressed
    # momentum): the gradient's form and the momentum's (1-bit Adam: 100 exact steps first)
    "float32-noclip": {"optim.grad_clip": "0"},
    "onebit-noclip": {"optim.grad_clip": "0", "train.grad_compression": "onebit"},
    "onebit-noclip-no-feedback": {"optim.grad_clip": "0", "train.grad_compression": "onebit",
                                  "train.error_feedback": "false"},
    "onebit-momentum": {"optim.grad_clip": "0", "train.grad_compression": "onebit",
                        "train.compress_momentum": "true", "train.compress_warmup": "100"},
    "onebit-momentum-no-feedback": {"optim.grad_clip": "0", "train.grad_compression": "onebit",
                                    "train.compress_momentum": "true", "train.compress_warmup": "100",
                                    "train.error_feedback": "false"},
    # DiLoCo: the two nodes train apart, meeting every 8 steps: the paper's outer Nesterov
    # (lr 0.7, momentum 0.9), MaxText's lr, a half-half pair and plain averaging
    "diloco-8": {"diloco.every": "8"},
    "diloco-8-lr0.3": {"diloco.every": "8", "diloco.outer_lr": "0.3"},
    "diloco-8-lr0.5-m0.5": {"diloco.every": "8", "diloco.outer_lr": "0.5", "diloco.outer_momentum": "0.5"},
    "diloco-8-average": {"diloco.every": "8", "diloco.outer_lr": "1.0", "diloco.outer_momentum": "0"},
    "diloco-8-average-int8": {"diloco.every": "8", "diloco.outer_lr": "1.0", "diloco.outer_momentum": "0",
                              "train.grad_compression": "int8"},
}


def last(path: pathlib.Path, key: str) -> float:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r[key] for r in rows if key in r][-1]


def run_dir(workdir: str, label: str, seed: int, seeds: list[int]) -> pathlib.Path:
    return pathlib.Path(workdir) / (label if len(seeds) == 1 else f"{label}-seed{seed}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--text", required=True, help="a text corpus (data.kind=text)")
    p.add_argument("--config", default="gpt2_tiny_dp8")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--workdir", default="runs/compression")
    p.add_argument("--out", default="", help="the curves' figure (meshtrain compare --out)")
    p.add_argument("--only", default="", help="a comma list of SETTINGS' labels (default: all)")
    p.add_argument("--seeds", default="0", help="a comma list of train.seed values")
    args = p.parse_args()
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    labels = [s for s in args.only.split(",") if s] or list(SETTINGS)
    base = [f"--config={args.config}", "--config.mesh.dcn=data:2", "--config.data.kind=text",
            f"--config.data.path={args.text}", f"--config.train.steps={args.steps}",
            f"--config.train.eval_every={max(args.steps // 12, 1)}", "--config.train.log_every=10",
            "--config.checkpoint.every=0", "--config.train.trackers=jsonl"]
    results = {}  # label -> [(train loss, eval loss) a seed]
    for label in labels:
        for seed in seeds:
            workdir = run_dir(args.workdir, label, seed, seeds)
            extra = [f"--config.{k}={v}" for k, v in SETTINGS[label].items()] + [f"--config.train.seed={seed}"]
            subprocess.run([sys.executable, "-m", "meshtrain.train", *base, *extra, f"--workdir={workdir}"],
                           check=True)
            metrics = workdir / "metrics.jsonl"
            results.setdefault(label, []).append((last(metrics, "loss"), last(metrics, "eval_loss")))
    mean = {label: sum(e for _, e in rows) / len(rows) for label, rows in results.items()}
    print(f"{'setting':28} {'train loss':>10} {'eval loss':>10} {'eval range':>15} {'vs float32':>11}")
    for label, rows in results.items():
        train = sum(t for t, _ in rows) / len(rows)
        spread = f"{min(e for _, e in rows):.4f}-{max(e for _, e in rows):.4f}" if len(rows) > 1 else "-"
        ref = "float32-noclip" if "noclip" in label or "momentum" in label else "float32"
        vs = f"{(mean[label] / mean[ref] - 1) * 100:+.2f}%" if ref in mean else "-"
        print(f"{label:28} {train:10.4f} {mean[label]:10.4f} {spread:>15} {vs:>11}")
    if args.out:
        runs = [str(run_dir(args.workdir, label, seeds[0], seeds)) for label in results]
        subprocess.run([sys.executable, "-m", "meshtrain.compare", *runs, f"--out={args.out}",
                        f"--labels={','.join(results)}"], check=True)


if __name__ == "__main__":
    main()
