"""Runs that hang while their processes stay alive, and stragglers, with real processes.

A test hook (tests/fault_run.py, run in place of `python -m meshtrain.train` directly or
through tests/fault_python as launch/local.sh's PYTHON) blocks, puts to sleep or slows
one process's data iterator. Every process then reports where it was and exits 3 within
train.hang_timeout + 5 s, and a rerun resumes with the losses of an unbroken run; a
slowed process is named as a straggler, and the even steps before it are not."""

import json
import re
import subprocess
import sys
import time

import pytest

from meshtrain.runlog import goodput
from meshtrain.train import main
from support.processes import ENV, FEW_ROWS, ONE_DEVICE_EACH, ROOT, losses, steps_on_disk, trainer

pytestmark = pytest.mark.slow
TINY = "gpt2_tiny_dp8"
HANG_TIMEOUT = 5
RUN = ["--config.train.steps=12", "--config.train.log_every=1", "--config.train.eval_every=0",
       "--config.checkpoint.every=4", "--config.optim.warmup_steps=2", FEW_ROWS]
FAULT_PYTHON = {"PYTHON": str(ROOT / "tests" / "fault_python"), "FAULT_PYTHON": sys.executable}


def fault(**what) -> dict:
    return {"MESHTRAIN_TEST_FAULT": json.dumps(what)}


def fault_began(log: str) -> float:
    """The wall time fault_run.py printed when the fault began."""
    return float(re.search(r"^fault: process \d+ \w+ before step \d+ at ([\d.]+)$", log, re.M).group(1))


def pid_of(log0: str, process: int) -> str:
    """Process `process`'s pid, from process 0's start-up lines."""
    return re.search(rf"^  process {process}: host \S+, pid (\d+),", log0, re.M).group(1)


def local_sh(n: int, *args, env: dict, one_device_each: bool = True):
    """launch/local.sh with the fault hook, one simulated device a process (else 8 / n);
    -> (status, stderr, wall time when it ended)."""
    mesh = [ONE_DEVICE_EACH] if one_device_each else []
    done = subprocess.run([str(ROOT / "launch" / "local.sh"), str(n), TINY, *mesh, *args], cwd=ROOT,
                          env={**ENV, **FAULT_PYTHON, **env}, capture_output=True, text=True, timeout=300)
    return done.returncode, done.stderr, time.time()


def test_a_blocked_data_iterator_is_reported_exits_3_and_the_rerun_resumes_like_an_unbroken_run(tmp_path):
    w = tmp_path / "w"
    args = [f"--config={TINY}", *RUN, f"--workdir={w}", f"--config.train.hang_timeout={HANG_TIMEOUT}"]
    hung = subprocess.Popen([sys.executable, str(ROOT / "tests" / "fault_run.py"), *args], cwd=ROOT,
                            env={**ENV, **fault(kind="block", step=10)}, stdout=open(tmp_path / "hung.txt", "w"),
                            stderr=subprocess.STDOUT)
    one = tmp_path / "one"  # meanwhile, the unbroken run (no watchdog in the test's own process)
    assert main([f"--config={TINY}", *RUN, f"--workdir={one}", "--config.train.hang_timeout=0"]) == 0
    status = hung.wait(timeout=300)
    ended = time.time()
    log = (tmp_path / "hung.txt").read_text()
    took = ended - fault_began(log)
    print(f"blocked before step 10: exit {status} {took:.1f} s later (hang_timeout={HANG_TIMEOUT})")
    assert status == 3, log[-3000:]
    assert took < HANG_TIMEOUT + 5
    assert re.search(r"^meshtrain: error: hang in step 10: process 0 \(host \S+, pid \d+\) is in its own code "
                     r"\(input, host code\) before dispatching step 10 \(last finished step 9\): no progress for "
                     r"[\d.]+ s, longer than the bound on a step \(train.hang_timeout=5\)\.$", log, re.M), log[-3000:]
    # The blocked thread's stack, innermost first: the wait, the hook's __next__, the loop.
    assert re.search(r'threading\.py", line \d+ in wait\n.*fault_run\.py", line \d+ in __next__\n'
                     r'.*meshtrain/run/loop\.py", line \d+ in train_loop\n', log), log[-3000:]
    assert log.rstrip().endswith("exits with status 3 (a hang). Committed checkpoints are kept; the latest is "
                                 f"step 8 in {w / 'checkpoints'}, and rerunning the same command (or "
                                 f"resubmitting the job) resumes from it.")
    assert "Traceback" not in log and steps_on_disk(w)[-1] == 8

    rerun = trainer(args, tmp_path / "rerun.txt")  # the same command, without the hook
    assert rerun.wait(timeout=300) == 0, (tmp_path / "rerun.txt").read_text()[-3000:]
    assert "resuming from step 8" in (tmp_path / "rerun.txt").read_text()
    assert losses(w) == losses(one) and sorted(losses(w)) == list(range(1, 13))  # exactly
    # goodput.jsonl: the hung piece's wait is its "hang" share; the rerun trained steps 9
    # again (the hung piece finished it, but its last checkpoint is step 8).
    hung_piece, rerun_piece = goodput.read_pieces(w)
    assert HANG_TIMEOUT <= hung_piece["seconds"]["hang"] < HANG_TIMEOUT + 5
    assert hung_piece["steps"]["last"] == 9 and rerun_piece["steps"]["repeated"] == 1
    total = goodput.add_up([hung_piece, rerun_piece])
    assert sum(total["seconds"].values()) == pytest.approx(total["wall_s"], rel=1e-3)
    assert "repeated" in goodput.line(total) and "hang" in goodput.line(total)


def test_two_processes_one_asleep_before_a_step_both_exit_3_and_name_it(tmp_path):
    """Process 1 sleeps before step 15, alive; process 0 waits for it in the step's
    collectives. Steps 1-14 are an even run: no straggler is named there. Four devices a
    process: with one, the sleeper's own watchdog can reach its bound first and stop process 0
    with status 1 before process 0 reports its wait (either is a clean end; this test reads
    process 0's report)."""
    w = tmp_path / "w"
    status, err, ended = local_sh(
        2, f"--workdir={w}", "--config.train.steps=20", "--config.train.log_every=1",
        "--config.train.eval_every=0", "--config.checkpoint.every=0", "--config.train.straggler_every=4",
        f"--config.train.hang_timeout={HANG_TIMEOUT}", env=fault(kind="sleep", step=15, process=1, seconds=600),
        one_device_each=False)
    log0, log1 = ((w / "logs" / f"process_{i}.log").read_text() for i in range(2))
    took = ended - fault_began(log1)
    print(f"process 1 asleep before step 15: both exited {took:.1f} s later (hang_timeout={HANG_TIMEOUT})")
    assert status == 3 and "exit statuses by process: 3 3" in err, (err, log0[-3000:])
    assert took < HANG_TIMEOUT + 5
    pid1 = pid_of(log0, 1)
    # The waiting process names the sleeping one and the step.
    assert re.search(r"^meshtrain: error: hang in step 15: process 0 \(host \S+, pid \d+\) is waiting for the "
                     r"devices to finish step 15", log0, re.M), log0[-3000:]
    assert "step 15: dispatched (not finished) by process 0; not dispatched by process 1." in log0
    assert "wait in step 15's collectives for process 1 (host " in log0 and f"pid {pid1}), which never" in log0
    # The sleeping process reports itself, with the stack of its sleep.
    assert re.search(r"^meshtrain: error: hang in step 15: process 1 \(host \S+, pid \d+\) is in its own code",
                     log1, re.M), log1[-3000:]
    assert re.search(r'fault_run\.py", line \d+ in __next__\n.*meshtrain/run/loop\.py", line \d+ in train_loop', log1)
    assert "is a straggler" not in log0 + log1 and "Traceback" not in log0 + log1


def test_a_process_slowed_on_purpose_is_named_and_run_json_keeps_the_medians(tmp_path):
    """Process 1 sleeps 0.3 s before each batch from step 13 on (windows of 4 steps): named
    for steps 13-20, its first two slow windows; the even steps 1-12 name no one."""
    w = tmp_path / "w"
    status, err, _ = local_sh(
        2, f"--workdir={w}", "--config.train.steps=28", "--config.train.log_every=7",
        "--config.train.eval_every=0", "--config.checkpoint.every=0", "--config.train.straggler_every=4",
        env=fault(kind="slow", step=13, process=1, seconds=0.3))
    log0 = (w / "logs" / "process_0.log").read_text()
    assert status == 0, (err, log0[-3000:])
    named = re.findall(r"^meshtrain: warning: process (\d) \(host \S+, pid (\d+)\) is a straggler: in steps "
                       r"(\d+-\d+) its own time per step .* was ([\d.]+) s against a median of ([\d.]+) s", log0, re.M)
    print("named:", named)
    assert [(p, pid, steps) for p, pid, steps, _, _ in named] == [("1", pid_of(log0, 1), "13-20")], log0[-3000:]
    assert float(named[0][3]) >= 0.3 > 0.1 > float(named[0][4])
    report = json.loads((w / "run.json").read_text())["stragglers"]
    print("run.json stragglers:", report)
    assert report["named"] == [1] and report["every"] == 4 and report["windows"] >= 5
    own = [p["own_s_per_step"] for p in report["processes"]]
    assert own[0] < 0.1 and own[1] > own[0] + 0.1  # over the run: 3 even windows, 4 slow ones
