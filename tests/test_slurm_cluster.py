"""Slurm test tier: a private cluster runs sbatch scripts whose srun steps have 2 or 4 tasks.

tests/ is not a package: pytest's default (prepend) import mode puts tests/ on sys.path,
so the helper is imported by its bare module name; importing the fixture registers it here.
"""
import pytest

from support.slurm_cluster import SlurmCluster, skip_reason, slurm  # noqa: F401  (slurm: fixture)

TASK = "echo $SLURM_PROCID $SLURM_NTASKS $SLURM_NODEID $SLURM_LOCALID $SLURM_STEP_ID > task-$SLURM_PROCID.txt"


def _script(tmp_path, srun_args: str):
    script = tmp_path / "job.sbatch"
    script.write_text(
        "#!/bin/bash\n"
        f"#SBATCH --output={tmp_path}/batch-%j.out\n"
        "[ -z \"$SLURM_STEP_ID\" ] || exit 7  # the batch shell is not a step\n"
        f"srun {srun_args} bash -c '{TASK}'\n")
    return script


def _tasks(tmp_path, n):
    return [(tmp_path / f"task-{r}.txt").read_text().split() for r in range(n)]


def test_sbatch_srun_two_tasks(slurm, tmp_path):  # noqa: F811
    job = slurm.sbatch(["--ntasks=2", "--cpus-per-task=1", str(_script(tmp_path, "-n2"))], cwd=tmp_path)
    info = slurm.wait_state(job, timeout=20)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), (tmp_path / f"batch-{job}.out").read_text()
    # PROCID NTASKS NODEID LOCALID STEP_ID
    assert _tasks(tmp_path, 2) == [["0", "2", "0", "0", "0"], ["1", "2", "0", "1", "0"]]
    assert slurm.squeue_lines() == []


def test_two_node_cluster_overrides_gpu_directives(tmp_path):
    """A GPU template's directives, overridden on the command line, on two slurmds on this host."""
    if reason := skip_reason():
        pytest.skip(reason)
    script = _script(tmp_path, "")
    script.write_text(script.read_text().replace("#!/bin/bash\n", "#!/bin/bash\n#SBATCH --nodes=2\n"
                      "#SBATCH --gpus-per-node=8\n#SBATCH --ntasks-per-node=8\n#SBATCH --cpus-per-task=12\n"
                      "#SBATCH --signal=TERM@120\n#SBATCH --requeue\n"))
    cluster = SlurmCluster(nodes=2, cpus=2)
    try:
        job = cluster.sbatch(["--gpus-per-node=0", "--ntasks-per-node=2", "--cpus-per-task=1", str(script)],
                             cwd=tmp_path)
        info = cluster.wait_state(job, timeout=20)
        assert (info["JobState"], info["NumNodes"]) == ("COMPLETED", "2"), info
        assert _tasks(tmp_path, 4) == [["0", "4", "0", "0", "0"], ["1", "4", "0", "1", "0"],
                                       ["2", "4", "1", "0", "0"], ["3", "4", "1", "1", "0"]]
    finally:
        cluster.stop()
