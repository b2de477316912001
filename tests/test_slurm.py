"""The Slurm tier: launch/slurm.sbatch on a real (one-node, loopback) Slurm cluster.

The GPU template's directives are overridden on the sbatch command line for 2 tasks with
4 simulated CPU devices each. The job trains and checkpoints, is stopped with
`scancel --signal=TERM` (every task saves the same step and exits 0), is submitted again
and resumes; its losses equal the single-process 8-device run's.
"""

import re
import sys

import numpy as np
import pytest

from meshtrain.train import main
from processes import ROOT, logged, losses, steps_on_disk, wait_for
from slurm_cluster import slurm  # noqa: F401  (the fixture)

pytestmark = pytest.mark.slow
SBATCH = str(ROOT / "launch" / "slurm.sbatch")
# Two tasks on this one node, no GPUs, one core each: overrides of the template's directives.
CPU_JOB = ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--gpus-per-node=0"]
RUN = ["--config.train.steps=24", "--config.train.log_every=1", "--config.train.eval_every=0",
       "--config.checkpoint.every=4"]


def submit(slurm, tmp_path, *args, env_workdir=None):  # noqa: F811
    env = {"WORKDIR": str(env_workdir or tmp_path / "w"), "PYTHON": sys.executable,
           "PYTHONPATH": str(ROOT)}
    slurm.env.update(env)
    return slurm.sbatch([*CPU_JOB, SBATCH, *args], cwd=tmp_path)


def rank_log(tmp_path, job, rank) -> str:
    path = tmp_path / "logs" / f"meshtrain-{job}-rank{rank}.out"
    return path.read_text() if path.exists() else ""


def test_sbatch_trains_is_preempted_with_term_and_resumes_like_one_process(slurm, tmp_path):  # noqa: F811
    one = tmp_path / "one"
    assert main(["--config=gpt2_tiny_dp8", *RUN, f"--workdir={one}"]) == 0

    w = tmp_path / "w"
    first = submit(slurm, tmp_path, "gpt2_tiny_dp8", *RUN)
    slurm.wait_state(first, "RUNNING", timeout=60)
    print("squeue:", *slurm.squeue_lines(), sep="\n  ")
    wait_for(lambda: re.search(r"^step +(9|1\d)/", rank_log(tmp_path, first, 0), re.M), what="step 9")
    slurm.scancel(first, "TERM")
    info = slurm.wait_state(first, timeout=120)
    log0 = rank_log(tmp_path, first, 0)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), (info, log0[-3000:])
    stopped = int(log0.split("preempted (SIGTERM) at step ")[1].split(":")[0])
    assert stopped < 24 and steps_on_disk(w)[-1] == stopped
    for rank in range(2):  # both tasks wrote their shards of that one step
        assert (w / "checkpoints" / f"step_{stopped}" / "state" / f"ocdbt.process_{rank}").is_dir()
    assert "processes: 2 (SLURM job" in log0
    job_log = (tmp_path / f"meshtrain-{first}.out").read_text()  # the template's own default
    assert "srun exited with status 0" in job_log
    print(f"job {first}: {info['JobState']} {info['ExitCode']}, stopped at step {stopped}")

    second = submit(slurm, tmp_path, "gpt2_tiny_dp8", *RUN)
    info = slurm.wait_state(second, timeout=180)
    log0 = rank_log(tmp_path, second, 0)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), (info, log0[-3000:])
    assert f"resuming from step {stopped}" in log0 and logged(tmp_path / "logs" / f"meshtrain-{second}-rank0.out", 24)
    got, want = losses(w), losses(one)
    assert sorted(got) == list(range(1, 25))
    np.testing.assert_allclose([got[k] for k in sorted(got)], [want[k] for k in sorted(want)], rtol=1e-5)
    print(f"job {second}: {info['JobState']} {info['ExitCode']}, resumed from step {stopped}")


def test_python_without_srun_in_a_two_task_job_is_told_to_use_srun(slurm, tmp_path):  # noqa: F811
    script = tmp_path / "direct.sbatch"
    script.write_text(f"#!/bin/bash\n{sys.executable} -m meshtrain.train --config=gpt2_tiny_dp8\n")
    slurm.env["PYTHONPATH"] = str(ROOT)
    job = slurm.sbatch(["--ntasks=2", "--cpus-per-task=1", f"--output={tmp_path}/direct-%j.out",
                        str(script)], cwd=tmp_path)
    info = slurm.wait_state(job, timeout=60)
    out = (tmp_path / f"direct-{job}.out").read_text()
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "2:0"), out
    assert "started outside srun" in out and "srun python -m meshtrain.train" in out
    assert "Traceback" not in out
