"""launch/slurm.sbatch: its decisions against fake Slurm commands (fast), then the real Slurm
tier on a one-node loopback cluster (tests/support/slurm_cluster.py).

The GPU template's directives are overridden on the sbatch command line for 2 tasks with
4 simulated CPU devices each. One job is stopped with `scancel --signal=TERM` (every task
saves the same step and exits 0), is submitted again and resumes; another reaches its
time limit (`--time=1`), saves, is requeued by the script and resumes, as often as it
takes. Both end with the losses of an unbroken run. The time-limit job, which mostly
waits on Slurm's clock, runs on a cluster of its own beside the module's other tests.
"""

import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from meshtrain.train import main
from support.processes import ENV, FEW_ROWS, ONE_DEVICE_EACH, ROOT, logged, losses, steps_on_disk, wait_for
from support.slurm_cluster import SlurmCluster, first_job_id, skip_reason, slurm  # noqa: F401  (slurm: the fixture)

SBATCH = str(ROOT / "launch" / "slurm.sbatch")
# Two tasks on this one node, no GPUs: overrides of the template's directives. Each task's
# CPUs come from the template (the node's CPUs / 2).
CPU_JOB = ["--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0"]
RUN = ["--config.train.steps=24", "--config.train.log_every=1", "--config.train.eval_every=0",
       "--config.checkpoint.every=4", FEW_ROWS]


def test_outside_slurm_it_says_how_to_submit_and_creates_nothing(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    r = subprocess.run(["bash", SBATCH, "gpt2_tiny_dp8"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 2, r
    assert "submit it with `sbatch launch/slurm.sbatch CONFIG [--config.key=value ...]`" in r.stderr
    assert list(tmp_path.iterdir()) == []  # no logs/, no runs/


# Fake srun, scancel and scontrol: srun runs one "task" that saves and exits on SIGTERM, as
# the trainer does, and kills it at once on a SIGTERM of its own, as the real srun does.
FAKES = {
    "srun": """echo "$*" > "$FAKE/srun.args"; echo "$SRUN_CPUS_PER_TASK" > "$FAKE/srun.env"
bash "$FAKE/task" & task=$!
echo $task > "$FAKE/task.pid"
trap 'echo "srun got SIGTERM: killed its task" >> "$FAKE/events"; kill -KILL $task; exit 137' TERM
while kill -0 $task 2>/dev/null; do wait $task; done; wait $task""",
    # FAKE_PREEMPTED: the task writes run.json's summary on SIGTERM, with this "preempted"
    "task": """trap 'echo "task saved" >> "$FAKE/events"
[[ -n ${FAKE_PREEMPTED:-} ]] && echo "{\\"summary\\": {\\"end_step\\": 9, \\"preempted\\": $FAKE_PREEMPTED}}" > "$WORKDIR/run.json"
exit ${FAKE_STATUS:-0}' TERM
echo "task started" >> "$FAKE/events"
for _ in $(seq ${FAKE_TICKS:-600}); do sleep 0.05; done
echo "task finished" >> "$FAKE/events"; exit ${FAKE_STATUS:-0}""",
    "scancel": """echo "scancel $*" >> "$FAKE/events"; [[ $1 == --signal=TERM ]] && kill -TERM $(cat "$FAKE/task.pid")""",
    "scontrol": """case $1 in
  show) echo "JobId=42 JobState=RUNNING PreemptTime=${FAKE_PREEMPT_TIME:-None}" ;;
  requeue) echo "scontrol requeue $2" >> "$FAKE/events" ;;
esac""",
}


def fake_job(tmp_path, **env):
    """launch/slurm.sbatch started as Slurm would (job 42, 2 tasks on a 16-CPU node), with
    the fake commands first on PATH; its own session, so its group can be signalled."""
    fake = tmp_path / "fake"
    fake.mkdir()
    for name, body in FAKES.items():
        (fake / name).write_text("#!/bin/bash\n" + body + "\n")
        (fake / name).chmod(0o755)
    (fake / "events").write_text("")
    job_env = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")},
               "PATH": f"{fake}:{os.environ['PATH']}", "FAKE": str(fake), "SLURM_JOB_ID": "42",
               "SLURM_NTASKS": "2", "SLURM_JOB_NUM_NODES": "1", "SLURM_CPUS_ON_NODE": "16",
               "SLURM_TASKS_PER_NODE": "2", "WORKDIR": str(tmp_path / "w"), **env}
    job = subprocess.Popen(["bash", SBATCH, "gpt2_tiny_dp8", "--config.train.steps=9"], cwd=tmp_path,
                           env=job_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
    wait_for(lambda: "task started" in (fake / "events").read_text(), timeout=30, what="the task")
    return job, fake


def events(fake) -> list[str]:
    return (fake / "events").read_text().splitlines()


def finish(job) -> tuple[int, str]:
    out = job.communicate(timeout=30)[0]
    return job.returncode, out


def test_the_time_limit_warning_saves_then_requeues(tmp_path):
    job, fake = fake_job(tmp_path)
    os.kill(job.pid, signal.SIGUSR1)  # --signal=B:USR1@300
    status, out = finish(job)
    assert events(fake) == ["task started", "scancel --signal=TERM 42", "task saved", "scontrol requeue 42"], out
    assert status == 0 and "time limit: requeueing" in out
    # The task's environment: CPUs = 16 on the node / 2 tasks.
    assert (fake / "srun.env").read_text().split() == ["8"]
    assert "-m meshtrain.train --config=gpt2_tiny_dp8 --workdir=" in (fake / "srun.args").read_text()


def test_sigterm_to_the_whole_script_group_saves_without_requeue(tmp_path):
    """`scancel --full --signal=TERM` signals the script's process group: srun, in its own,
    is spared (it would kill its task), and the task saves."""
    job, fake = fake_job(tmp_path)
    os.killpg(job.pid, signal.SIGTERM)
    status, out = finish(job)
    assert events(fake) == ["task started", "scancel --signal=TERM 42", "task saved"], out
    assert status == 0 and "stopped on SIGTERM after saving: resubmit the same command" in out


def test_a_finished_run_is_not_requeued_and_a_preempted_one_is(tmp_path):
    (tmp_path / "done").mkdir()
    job, fake = fake_job(tmp_path / "done", FAKE_TICKS="1")
    status, out = finish(job)
    assert events(fake) == ["task started", "task finished"] and status == 0, out
    # Preempted with a grace time: Slurm sent SIGTERM to the task only, and marks the job.
    (tmp_path / "pre").mkdir()
    job, fake = fake_job(tmp_path / "pre", FAKE_PREEMPT_TIME="2025-01-01T00:00:00")
    os.kill(int((fake / "task.pid").read_text()), signal.SIGTERM)
    status, out = finish(job)
    assert events(fake) == ["task started", "task saved", "scontrol requeue 42"] and status == 0, out
    assert "preemption: requeueing" in out


def test_a_run_that_ends_as_the_time_limit_warning_comes_is_not_requeued(tmp_path):
    """The warning came as the run took its last step: run.json's summary, written by this
    run, says nothing stopped it early (preempted null), so the job ends instead of
    requeueing a run with nothing left to train. A summary that says SIGTERM, or one left
    by an earlier run, is requeued."""
    for case, preempted, requeued in (("ended", "null", False), ("saved", '"SIGTERM"', True), ("old", "", True)):
        (tmp_path / case / "w").mkdir(parents=True)
        if case == "old":  # a finished run's summary from before this job
            (tmp_path / case / "w" / "run.json").write_text('{"summary": {"end_step": 9, "preempted": null}}')
            os.utime(tmp_path / case / "w" / "run.json", (time.time() - 60,) * 2)
        job, fake = fake_job(tmp_path / case, FAKE_PREEMPTED=preempted)
        os.kill(job.pid, signal.SIGUSR1)
        status, out = finish(job)
        assert status == 0 and ("scontrol requeue 42" in events(fake)) == requeued, (case, out)
        assert ("the run reached its end as the time limit came: nothing to requeue" in out) == (not requeued)
        assert "resubmit" not in out, out


def test_a_hang_is_requeued_once_per_job_then_fails(tmp_path):
    for attempt, requeued in ((1, True), (2, False)):  # one job: the second hang is not requeued
        (tmp_path / str(attempt)).mkdir()
        job, fake = fake_job(tmp_path / str(attempt), FAKE_TICKS="1", FAKE_STATUS="3",
                             WORKDIR=str(tmp_path / "w"))
        status, out = finish(job)
        assert ("scontrol requeue 42" in events(fake)) == requeued, out
        assert status == (0 if requeued else 3)
        assert ("hang (1 of at most 1): requeueing" in out) == requeued
        assert ("a hang again: not requeueing" in out) == (not requeued)


def test_bad_input_is_not_requeued(tmp_path):
    job, fake = fake_job(tmp_path, FAKE_STATUS="2")
    os.kill(job.pid, signal.SIGUSR1)
    status, out = finish(job)
    assert events(fake) == ["task started", "scancel --signal=TERM 42", "task saved"] and status == 2, out


def submit(slurm, tmp_path, *args, sbatch_args=(), env=None):  # noqa: F811
    slurm.env.update({"WORKDIR": str(tmp_path / "w"), "PYTHON": sys.executable, "PYTHONPATH": str(ROOT),
                      **(env or {})})
    return slurm.sbatch([*CPU_JOB, *sbatch_args, SBATCH, *args], cwd=tmp_path)


def rank_log(tmp_path, job, rank) -> str:
    path = tmp_path / "logs" / f"meshtrain-{job}-rank{rank}.out"
    return path.read_text() if path.exists() else ""


@pytest.mark.slow
def test_sbatch_trains_is_preempted_with_term_and_resumes_like_one_process(slurm, tmp_path):  # noqa: F811
    w = tmp_path / "w"
    first = submit(slurm, tmp_path, "gpt2_tiny_dp8", ONE_DEVICE_EACH, *RUN)
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

    second = submit(slurm, tmp_path, "gpt2_tiny_dp8", ONE_DEVICE_EACH, *RUN)
    one = tmp_path / "one"  # the unbroken run, in this process while the second job starts
    assert main(["--config=gpt2_tiny_dp8", *RUN, f"--workdir={one}"]) == 0
    info = slurm.wait_state(second, timeout=180)
    log0 = rank_log(tmp_path, second, 0)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), (info, log0[-3000:])
    assert f"resuming from step {stopped}" in log0 and logged(tmp_path / "logs" / f"meshtrain-{second}-rank0.out", 24)
    got, want = losses(w), losses(one)
    assert sorted(got) == list(range(1, 25))
    np.testing.assert_allclose([got[k] for k in sorted(got)], [want[k] for k in sorted(want)], rtol=1e-5)
    print(f"job {second}: {info['JobState']} {info['ExitCode']}, resumed from step {stopped}")


@pytest.mark.slow
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


# The job's first run is slowed to 1.5 s a step (tests/fault_run.py's "slow" fault, in the
# job's first run only): 40 steps take it a minute at least, so it cannot finish before its
# time limit on any machine; the requeued runs train at full speed.
STEPS = 40
LONG = [f"--config.train.steps={STEPS}", "--config.train.log_every=1", "--config.train.eval_every=0",
        "--config.checkpoint.every=0"]  # saved only at the end and on SIGTERM
SLOW_FIRST_RUN = {"PYTHON": str(ROOT / "tests" / "fault_python"), "FAULT_PYTHON": sys.executable,
                  "MESHTRAIN_TEST_FAULT": '{"kind": "slow", "seconds": 1.5, "restart": 0}'}


class TimeLimitJob(threading.Thread):
    """The time-limit test's job and its unbroken twin, on a cluster of their own. They
    mostly wait on Slurm's clock (its first time-limit check, 30 s after slurmctld starts;
    the requeued job held ~6 s) and on the job's slowed first run, so they run beside the
    module's other tests, which use the module's cluster (`slurm`); the test waits for them."""

    def __init__(self, tmp_path):
        super().__init__(name="time-limit job", daemon=True)
        self.tmp_path, self.error = tmp_path, None

    def run(self):
        try:
            self._run()
        except BaseException as e:  # noqa: BLE001 - raised again in the test
            self.error = e

    def _run(self):
        ref = self.tmp_path / "ref"
        cluster = SlurmCluster(FirstJobId=str(first_job_id(apart=512)))  # apart from `slurm`'s jobs
        unbroken = subprocess.Popen([str(ROOT / "launch" / "local.sh"), "2", "gpt2_tiny_dp8", ONE_DEVICE_EACH, *LONG,
                                     f"--workdir={ref}"], cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, text=True)
        try:
            t0 = time.monotonic()
            self.job = submit(cluster, self.tmp_path, "gpt2_tiny_dp8", ONE_DEVICE_EACH, *LONG,
                              sbatch_args=["--time=1", "--signal=B:USR1@5"], env=SLOW_FIRST_RUN)
            self.info = cluster.wait_state(self.job, timeout=900)
            self.took = time.monotonic() - t0
            assert unbroken.wait(timeout=600) == 0, unbroken.stderr.read()[-3000:]
        finally:
            cluster.stop()
            if unbroken.poll() is None:
                unbroken.kill()

    def result(self) -> "TimeLimitJob":
        self.join(timeout=1200)
        assert not self.is_alive(), "the time-limit job did not end within 20 minutes"
        if self.error is not None:
            raise self.error
        return self


TIME_LIMIT_TEST = "test_time_limit_requeues_and_resumes_like_an_unbroken_run"


@pytest.fixture(scope="module", autouse=True)
def time_limit_job(request, tmp_path_factory):
    """Started with the module's first test, where the time-limit test is to run."""
    wanted = any(getattr(item, "module", None) is request.module and item.originalname == TIME_LIMIT_TEST
                 for item in request.session.items)
    if not wanted or skip_reason():
        yield None
        return
    job = TimeLimitJob(tmp_path_factory.mktemp("time_limit"))
    job.start()
    yield job
    job.join(timeout=1200)  # its cluster never outlives the module


@pytest.mark.slow
def test_time_limit_requeues_and_resumes_like_an_unbroken_run(time_limit_job):
    """--time=1 (one minute, Slurm's least), warned 5 s before the end (--signal=B:USR1@5).
    Slurm checks time limits every 30 s, the first time 30 s after slurmctld starts, so the
    warning comes at the first check at least 25 s after the job's start; the job is
    submitted as soon as its cluster is up, so that is the first check, ~28 s after the
    start (a job that started late would be warned at the next check, ~30 s later, with
    its first run still going). The script asks the tasks to save and requeues the job,
    which Slurm starts again ~6 s later (cred_expire=5) with a fresh minute, as often as it
    takes to finish. The unbroken run trains meanwhile, while the job's first run sleeps
    through its steps; both started with the module (`time_limit_job`)."""
    if reason := skip_reason():
        pytest.skip(reason)
    done = time_limit_job.result()
    tmp_path, ref, job, info, took = done.tmp_path, done.tmp_path / "ref", done.job, done.info, done.took
    job_log = (tmp_path / f"meshtrain-{job}.out").read_text()
    log0 = rank_log(tmp_path, job, 0)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), (info, job_log, log0[-3000:])
    restarts = int(info["Restarts"])
    assert restarts >= 1, f"the run fit into one allocation (its first run trains at 1.5 s a step)\n{job_log}"
    # The last run may be warned as it takes its last steps (a slow host): it ends, and the
    # script says so instead of requeueing (test_a_run_that_ends_as_the_time_limit_warning...).
    ended_when_warned = "the run reached its end as the time limit came: nothing to requeue" in job_log
    assert job_log.count("time limit: asking every task to save") == restarts + ended_when_warned, job_log
    assert job_log.count("time limit: requeueing") == restarts, job_log
    assert f"(restart {restarts})" in job_log and "srun exited with status 0" in job_log
    # Every stop saved a step, and the next run resumed from it and went past it.
    stops = [int(s) for s in re.findall(r"^preempted \(SIGTERM\) at step (\d+): saved", log0, re.M)]
    resumes = [int(s) for s in re.findall(r"^resuming from step (\d+)", log0, re.M)]
    assert stops == resumes and len(stops) == restarts and stops == sorted(set(stops)), (stops, resumes)
    assert logged(tmp_path / "logs" / f"meshtrain-{job}-rank0.out", STEPS)
    times = re.findall(r"^\S+T(\S{8})\S* job \d+: (.*)$", job_log, re.M)
    print(f"job {job}: {restarts} requeue(s), stopped at steps {stops}, "
          f"done {took:.0f} s after sbatch:", *(f"{t} {what[:100]}" for t, what in times), sep="\n  ")
    # metrics.jsonl of the requeued job: every step once, the losses of the unbroken run exactly.
    got, want = losses(tmp_path / "w"), losses(ref)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert got == want
