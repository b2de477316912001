"""The Slurm tier, hangs and deaths: launch/slurm.sbatch on a real (one-node, loopback)
Slurm cluster, two tasks, one of which sleeps before a step while staying alive, or kills
itself (the test hook tests/fault_run.py, run through tests/fault_python as the template's
PYTHON). A sleeper: both tasks report and exit 3 within train.hang_timeout + 5 s, srun
ends the job (FAILED, 3), and task 0's log names the sleeping task and the step. A kill -9:
task 0 names it within distributed.heartbeat_timeout + 5 s, and the job resubmitted
resumes with the losses of one process."""

import datetime
import json
import re
import sys

import numpy as np
import pytest

from support.processes import FEW_ROWS, ROOT
from support.slurm_cluster import slurm  # noqa: F401  (the fixture)

pytestmark = pytest.mark.slow
SBATCH = str(ROOT / "launch" / "slurm.sbatch")
CPU_JOB = ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--gpus-per-node=0"]
HANG_TIMEOUT = 5
RUN = ["--config.train.steps=20", "--config.train.log_every=1", "--config.train.eval_every=0",
       "--config.checkpoint.every=4", f"--config.train.hang_timeout={HANG_TIMEOUT}", FEW_ROWS]


def test_a_task_asleep_before_a_step_ends_the_job_with_status_3_naming_it(slurm, tmp_path):  # noqa: F811
    slurm.env.update({"WORKDIR": str(tmp_path / "w"), "PYTHONPATH": str(ROOT),
                      "PYTHON": str(ROOT / "tests" / "fault_python"), "FAULT_PYTHON": sys.executable,
                      "MESHTRAIN_HANG_REQUEUES": "0",  # the template's requeue after a hang: test_slurm.py
                      "MESHTRAIN_TEST_FAULT": json.dumps({"kind": "sleep", "step": 9, "process": 1,
                                                          "seconds": 600})})
    job = slurm.sbatch([*CPU_JOB, SBATCH, "gpt2_tiny_dp8", *RUN], cwd=tmp_path)
    info = slurm.wait_state(job, timeout=240)
    logs = [(tmp_path / "logs" / f"meshtrain-{job}-rank{r}.out").read_text() for r in range(2)]
    job_log = (tmp_path / f"meshtrain-{job}.out").read_text()
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "3:0"), (info, job_log, logs[0][-3000:])
    # srun's end, as the template logs it (whole seconds), against when the sleep began.
    ended = re.search(r"^(\S+) job \d+: srun exited with status 3 ", job_log, re.M)
    began = float(re.search(r"^fault: process 1 sleeps before step 9 at ([\d.]+)$", logs[1], re.M).group(1))
    took = datetime.datetime.fromisoformat(ended.group(1)).timestamp() - began
    print(f"job {job}: {info['JobState']} {info['ExitCode']}, srun ended {took:.0f} s (whole seconds) "
          f"after task 1 fell asleep (hang_timeout={HANG_TIMEOUT})")
    assert took < HANG_TIMEOUT + 5 + 1  # + 1: the log's time is rounded down to the second
    pid1 = re.search(r"^  process 1: host \S+, pid (\d+),", logs[0], re.M).group(1)
    assert re.search(r"^meshtrain: error: hang in step 9: process 0 \(host \S+, pid \d+\) is waiting for the "
                     r"devices to finish step 9", logs[0], re.M), logs[0][-3000:]
    assert "step 9: dispatched (not finished) by process 0; not dispatched by process 1." in logs[0]
    assert f"pid {pid1}), which never dispatched it" in logs[0]
    assert re.search(r"^meshtrain: error: hang in step 9: process 1 ", logs[1], re.M), logs[1][-3000:]
    assert re.search(r'fault_run\.py", line \d+ in __next__\n.*meshtrain/run/loop\.py", line \d+ in train_loop', logs[1])
    for log in logs:
        assert "exits with status 3 (a hang). Committed checkpoints are kept; the latest is step 8" in log


def test_a_task_killed_with_sigkill_is_named_and_a_resubmission_resumes_like_one_process(slurm, tmp_path):  # noqa: F811
    from meshtrain.train import main
    from support.processes import ONE_DEVICE_EACH, losses
    run = ["--config.train.steps=16", "--config.train.log_every=1", "--config.train.eval_every=0",
           "--config.checkpoint.every=4", "--config.distributed.heartbeat_timeout=4"]
    w = tmp_path / "w"
    slurm.env.update({"WORKDIR": str(w), "PYTHONPATH": str(ROOT),
                      "PYTHON": str(ROOT / "tests" / "fault_python"), "FAULT_PYTHON": sys.executable,
                      "MESHTRAIN_TEST_FAULT": json.dumps({"kind": "kill", "step": 11, "process": 1})})
    job = slurm.sbatch([*CPU_JOB, SBATCH, "gpt2_tiny_dp8", ONE_DEVICE_EACH, *run], cwd=tmp_path)
    info = slurm.wait_state(job, timeout=240)
    logs = [(tmp_path / "logs" / f"meshtrain-{job}-rank{r}.out").read_text() for r in range(2)]
    job_log = (tmp_path / f"meshtrain-{job}.out").read_text()
    assert info["JobState"] == "FAILED", (info, job_log, logs[0][-3000:])
    began = float(re.search(r"^fault: process 1 kills before step 11 at ([\d.]+)$", logs[1], re.M).group(1))
    named = re.search(r"^meshtrain: error: process 1 \(host \S+, pid \d+\) was lost \(last heard at step "
                      r"\d+\): silent for \d s \(distributed.heartbeat_timeout=4\)", logs[0], re.M)
    assert named, logs[0][-3000:]
    ended = re.search(r"^(\S+) job \d+: srun exited with status (\d+) ", job_log, re.M)
    took = datetime.datetime.fromisoformat(ended.group(1)).timestamp() - began
    print(f"job {job}: {info['JobState']} {info['ExitCode']}, srun ended {took:.0f} s (whole seconds) "
          f"after task 1 was killed (heartbeat_timeout=4)")
    assert took < 4 + 5 + 1  # + 1: the log's time is rounded down to the second
    assert "Committed checkpoints are kept; the latest is step 8" in logs[0]

    slurm.env.update({"PYTHON": sys.executable})  # the trainer itself, no fault
    again = slurm.sbatch([*CPU_JOB, SBATCH, "gpt2_tiny_dp8", ONE_DEVICE_EACH, *run], cwd=tmp_path)
    # The unbroken run, in this process while the resubmitted job starts.
    assert main(["--config=gpt2_tiny_dp8", *run, f"--workdir={tmp_path / 'one'}"]) == 0
    info = slurm.wait_state(again, timeout=240)
    log0 = (tmp_path / "logs" / f"meshtrain-{again}-rank0.out").read_text()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), (info, log0[-3000:])
    assert "resuming from step 8" in log0
    got, want = losses(w), losses(tmp_path / "one")
    assert sorted(got) == list(range(1, 17))
    np.testing.assert_allclose([got[k] for k in sorted(got)], [want[k] for k in sorted(want)], rtol=1e-5)
