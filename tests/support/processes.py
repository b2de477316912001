"""Starting real trainer processes from tests: free ports, launches, waiting, metrics."""

import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHON": sys.executable}
# gpt2_tiny_dp8 over two processes with one simulated device each (dp8's batch, model and
# losses), for the tests whose story is the processes: signals, hangs, lost peers, the
# checkpoint both write. With 4 devices a process, XLA:CPU runs each all-reduce as gloo
# rings over all 8 devices, one ring per gradient: a step costs 3x the CPU (docs/testing.md).
ONE_DEVICE_EACH = "--config.mesh.shape=data:2"
# A row a data replica of gpt2_tiny_dp8 (8, not its 32) for the same tests, on both sides of
# every comparison: what they check is the processes, not the rows, and two processes with one
# device each train a step of 8 rows in about half the CPU of 32 (docs/testing.md).
FEW_ROWS = "--config.train.batch_size=8"


def own_devices_env(**extra: str) -> dict:
    """This process's environment, and EXTRA, for a child that simulates its own CPU devices
    (no JAX_NUM_CPU_DEVICES, no XLA device-count flag): it keeps the suite's other XLA flags
    (LLVM -O1, tests/conftest.py) and compilation cache, so its programs compile as fast as
    the suite's and share their cache entries."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if not f.startswith("--xla_force_host_platform_device_count"))
    return {**env, **extra}


def free_port() -> int:
    """A free port (for JAX's coordination service, the one port a job opens for itself)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trainer(args, log: pathlib.Path, env=None, fault: dict | None = None) -> subprocess.Popen:
    """`python -m meshtrain.train ARGS`, output appended to `log`; with `fault`, the trainer
    with that fault in its data path (tests/fault_run.py)."""
    out = open(log, "a")
    run = [str(ROOT / "tests" / "fault_run.py")] if fault else ["-m", "meshtrain.train"]
    env = {**ENV, **(env or {}), **({"MESHTRAIN_TEST_FAULT": json.dumps(fault)} if fault else {})}
    proc = subprocess.Popen([sys.executable, *run, *args], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    proc.log = log  # what wait_for quotes when the process ends first
    return proc


def processes(n: int, args, logs: pathlib.Path, port: int | None = None,
              fault: dict | None = None) -> list[subprocess.Popen]:
    """N trainer processes joined by flags; process i logs to LOGS/pI.txt."""
    port = port or free_port()
    return [trainer([*args, f"--coordinator=localhost:{port}", f"--num_processes={n}",
                     f"--process_id={i}"], logs / f"p{i}.txt", fault=fault) for i in range(n)]


def local_sh(n: int, *args, timeout=300) -> subprocess.CompletedProcess:
    """launch/local.sh N ARGS..., to completion."""
    return subprocess.run([str(ROOT / "launch" / "local.sh"), str(n), *args], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=timeout)


def wait_for(predicate, timeout=180.0, what="condition", procs=()):
    """Polls `predicate` until it holds; fails after `timeout` s, or as soon as one of `procs`
    (Popen) has ended without it holding, with its status and its log's last lines (a
    trainer's), instead of waiting out the timeout for a process that can no longer do it."""
    deadline = time.monotonic() + timeout
    while not predicate():
        for proc in procs:
            if proc.poll() is not None and not predicate():
                log = getattr(proc, "log", None)
                tail = "\n".join(log.read_text().splitlines()[-15:]) if log is not None and log.exists() else ""
                said = f"waiting for {what}: pid {proc.pid} ended with status {proc.returncode} first"
                raise AssertionError(f"{said}:\n{tail}" if tail else said)
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def metric_rows(workdir: pathlib.Path) -> list[dict]:
    """WORKDIR/metrics.jsonl, one dict a row."""
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def losses(workdir: pathlib.Path) -> dict[int, float]:
    """{step: training loss} from WORKDIR/metrics.jsonl."""
    return {r["step"]: r["loss"] for r in metric_rows(workdir) if "loss" in r}


def exact_losses(workdir: pathlib.Path) -> dict[int, str]:
    """`losses` as float.hex(): for runs that must agree bitwise."""
    return {step: loss.hex() for step, loss in losses(workdir).items()}


def logged(log: pathlib.Path, step: int) -> bool:
    return log.exists() and re.search(rf"^step +{step}/", log.read_text(), re.M) is not None


def steps_on_disk(workdir: pathlib.Path) -> list[int]:
    ckpt = workdir / "checkpoints"
    return sorted(int(p.name[5:]) for p in ckpt.iterdir() if p.name[5:].isdigit()) if ckpt.exists() else []
