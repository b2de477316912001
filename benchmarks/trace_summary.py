"""python benchmarks/trace_summary.py TRACE.trace.json.gz [--steps 3] [--top 15]

Where a GPU step's device time goes, from the trace `train.profile` writes
(docs/profiling.md): the kernels of every device stream summed by kind (matmul,
attention, memory copies, collectives, the fusions that write loop-stacked buffers, the
other fusions), per step, and the costliest kernels by name. Kernel names in a CUDA-graph
trace carry no HLO op, so the kinds are read off the names.

    python benchmarks/trace_summary.py runs/small/profile/plugins/profile/*/*.trace.json.gz
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import sys

# (kind, pattern on the kernel name), first match wins.
KINDS = (
    ("attention", re.compile(r"cudnn|fmha|sdpa|flash", re.I)),
    ("matmul", re.compile(r"^nvjet|gemm|cutlass|xmma|cublas", re.I)),
    ("collective", re.compile(r"nccl", re.I)),
    ("memcpy/memset", re.compile(r"memcpy|memset", re.I)),
    ("loop buffers (dynamic-update-slice)", re.compile(r"dynamic_update_slice")),
    ("other fusions", re.compile(r".")),
)


def kind_of(name: str) -> str:
    return next(k for k, pattern in KINDS if pattern.search(name))


def device_kernels(trace: dict) -> list[dict]:
    """The complete ('X') events on the trace's device processes (`/device:GPU:N`)."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    devices = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
               and str(e.get("args", {}).get("name", "")).startswith("/device:")}
    return [e for e in events if e.get("ph") == "X" and e.get("pid") in devices]


def summarise(kernels: list[dict], steps: int, top: int) -> list[str]:
    total = sum(e.get("dur", 0) for e in kernels)
    if not total:
        return ["no device kernels in the trace (a CPU run's trace has none)"]
    by_kind, by_name, count = collections.Counter(), collections.Counter(), collections.Counter()
    for e in kernels:
        by_kind[kind_of(e["name"])] += e["dur"]
        by_name[e["name"]] += e["dur"]
        count[e["name"]] += 1
    lines = [f"device kernel time: {total / 1e3 / steps:.2f} ms per step ({steps} steps traced)", "",
             "| kind | ms per step | share |", "|---|---|---|"]
    lines += [f"| {k} | {v / 1e3 / steps:.2f} | {100 * v / total:.1f}% |" for k, v in by_kind.most_common()]
    lines += ["", "| kernel | kind | ms per step | calls per step | share |", "|---|---|---|---|---|"]
    lines += [f"| `{n[:70]}` | {kind_of(n)} | {v / 1e3 / steps:.2f} | {count[n] / steps:g} | {100 * v / total:.1f}% |"
              for n, v in by_name.most_common(top)]
    return lines


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description="A GPU trace's device time by kernel kind.")
    ap.add_argument("trace", help="a .trace.json.gz (or .trace.json) from train.profile")
    ap.add_argument("--steps", type=int, default=3, help="steps the trace holds (train.profile=START:STOP)")
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args(argv)
    opener = gzip.open if args.trace.endswith(".gz") else open
    try:
        with opener(args.trace, "rt") as f:
            trace = json.load(f)
    except (OSError, ValueError) as e:
        print(f"trace_summary: cannot read {args.trace}: {e}", file=sys.stderr)
        return 2
    print("\n".join(summarise(device_kernels(trace), max(args.steps, 1), args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
