"""Reproduces docs/benchmarks.md, "Several processes on one machine".

Several processes on one machine: what joining costs, what gloo costs, how fast a loss is seen.

    python benchmarks/figures/multihost.py [--config=gpt2_tiny_dp8] [--steps=60]

1. Step time of one process with 8 simulated devices against 2 processes x 4 (the
   collectives between processes go through gloo over loopback), medians of the logged
   steps after the first 10, side by side in one run.
2. Start-up of the 2 processes: JAX's runtime, then the start agreement (run.json).
3. Time from `kill -9` of process 1 to the exit of process 0, and from SIGSTOP of
   process 1 (a host gone silent) to the exit of process 0 with heartbeat_timeout=4.
Goal (docs/benchmarks.md): a lost process, killed or silent, stops the others within
heartbeat_timeout + 1 s (issue 38 asks + 5 s).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import signal
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from support.processes import logged, processes, trainer, wait_for  # noqa: E402


def step_ms(workdir: pathlib.Path) -> float:
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return 1e3 * statistics.median(r["step_time_s"] for r in rows if "loss" in r and r["step"] > 10)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="gpt2_tiny_dp8")
    p.add_argument("--steps", type=int, default=60)
    a = p.parse_args()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="multihost-"))
    run = [f"--config={a.config}", f"--config.train.steps={a.steps}", "--config.train.log_every=1",
           "--config.train.eval_every=0", "--config.checkpoint.every=0"]

    one = trainer([*run, f"--workdir={tmp / 'one'}"], tmp / "one.txt")
    assert one.wait() == 0, (tmp / "one.txt").read_text()[-2000:]
    two = processes(2, [*run, f"--workdir={tmp / 'two'}"], tmp)
    assert [q.wait() for q in two] == [0, 0], (tmp / "p0.txt").read_text()[-2000:]
    ms1, ms2 = step_ms(tmp / "one"), step_ms(tmp / "two")
    start = json.loads((tmp / "two" / "run.json").read_text())["distributed"]["start_seconds"]
    print(f"step time, 1 process x 8 devices: {ms1:.1f} ms; 2 processes x 4: {ms2:.1f} ms "
          f"(ratio {ms2 / ms1:.2f})")
    print("start of 2 processes: " + ", ".join(f"{k} {v:.2f} s" for k, v in start.items()))

    long = [f"--config={a.config}", "--config.train.steps=100000", "--config.train.log_every=1",
            "--config.distributed.heartbeat_timeout=4"]
    for name, sig in (("kill -9", signal.SIGKILL), ("SIGSTOP", signal.SIGSTOP)):
        logs = tmp / name.replace(" ", "")
        logs.mkdir()
        procs = processes(2, long, logs)
        wait_for(lambda: logged(logs / "p0.txt", 3), what="step 3")  # noqa: B023
        procs[1].send_signal(sig)
        t0 = time.monotonic()
        status = procs[0].wait(timeout=120)
        took = time.monotonic() - t0
        procs[1].kill()
        procs[1].wait()
        print(f"{name} of process 1: process 0 exited with status {status} after {took:.2f} s")
    print(f"(logs in {tmp})")


if __name__ == "__main__":
    main()
