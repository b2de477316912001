"""A throwaway Slurm cluster (one slurmctld, one or more slurmd) on this machine, for tests.

Why it looks like this:
* Everything lives in one private temp dir: slurm.conf, state, spool, pid and log files,
  and the job-completion log. Client commands find the cluster only through SLURM_CONF
  in `SlurmCluster.env`; /etc/slurm and any system Slurm daemons are never used.
* Loopback only: SlurmctldHost=localhost, nodes at 127.0.0.1, and
  CommunicationParameters=NoCtldInAddrAny,NoInAddrAny so the daemons bind 127.0.0.1
  (on ports found free at start) instead of every interface.
* AuthType=auth/none and CredType=cred/none: no munge daemon or key, and anyone who can
  reach the ports may run jobs as root. For tests only, never for a real cluster.
* nodes=1 gives NodeName=localhost; nodes=N>1 gives node[1-N], N slurmd processes on
  this one host (each its own port and spool dir), so `--nodes=2` jobs really get two
  "nodes" with SLURM_NODEID 0/1. SlurmdParameters=config_overrides lets CPUs exceed
  the hardware (default CPUs = `nproc` per node).
* The daemons run in the foreground (-D) as our children in their own sessions; stop()
  sends TERM then KILL to the recorded daemon PIDs, then to every process still carrying
  this cluster's SLURM_CONF in its environment (slurmstepd daemonizes away from slurmd,
  and batch scripts and tasks inherit the submitter's env). Nothing of ours is left
  running and nothing else is touched (a task that scrubs its env, e.g. `env -i`, escapes).
* Job info without slurmdbd: `scontrol show job` knows a job until MinJobAge (300 s)
  after it ends. JobCompType=jobcomp/filetxt writes a one-line completion record that
  `sacct -c -j ID` (--completion) reads; plain `sacct -j ID` needs slurmdbd ("Slurm
  accounting storage is disabled"; accounting_storage/filetxt no longer exists in 22.05).
  job_info() uses scontrol first and the jobcomp record after the job has been purged.
* Quick scheduling, for the requeue tests: SchedulerParameters=sched_interval=1,bf_interval=1
  (a pending job is looked at every second, not every 60 / 30 s), and AuthInfo=cred_expire=5:
  Slurm holds a requeued batch job for cred_expire + 1 s (BeginTime; 121 s by default).
  The time-limit check (and the --signal warning it sends) runs every 30 s whatever the
  settings, the first time 30 s after slurmctld starts: PERIODIC_TIMEOUT is compiled into
  slurmctld (SlurmctldDebug=debug2 logs each check, "Testing job time limits").
* Job ids apart per pytest-xdist worker (FirstJobId): JAX's Slurm detection puts process
  0's coordination service on port 61440 + job id % 4096, so two clusters that both number
  their first job 1, running at once on this host, would start both jobs' services on one
  port, and one job's tasks would talk to the other's service (seen: a job aborted 11 s
  after start with "Socket closed" from the coordination service). A second cluster of the
  same worker, running beside its first, numbers its jobs apart again
  (`FirstJobId=str(first_job_id(apart=512))`).
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from signal import SIGKILL, SIGTERM

import pytest

BINARIES = ("slurmctld", "slurmd", "slurmstepd", "sbatch", "srun", "scontrol", "squeue", "sinfo", "scancel")
_PATH = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"  # the daemons live in sbin
_OUTER = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")  # input variables of an outer allocation
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL")


def skip_reason() -> str | None:
    """None when a cluster can be started here, else why not (for pytest.skip)."""
    missing = [b for b in BINARIES if shutil.which(b, path=_PATH) is None]
    if missing:
        return f"Slurm not installed (missing {', '.join(missing)}); apt-get install slurmctld slurmd slurm-client"
    if os.geteuid() != 0:
        return "the Slurm test cluster runs slurmd as root (SlurmUser=root); not root here"
    return None


def first_job_id(apart: int = 0) -> int:
    """1 for xdist worker gw0 (or no xdist), 1025 for gw1, ...: 1,024 jobs before two meet.
    `apart` (under 1,024) numbers a second cluster that runs beside the worker's first one."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return 1 + apart + 1024 * (int(worker[2:]) % 4 if worker[2:].isdigit() else 0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmCluster:
    def __init__(self, nodes: int = 1, cpus: int | None = None, start_timeout: float = 30.0, **conf: str):
        """conf: extra or overriding slurm.conf keys, e.g. KillWait="30"."""
        self.dir = d = Path(tempfile.mkdtemp(prefix="mtslurm-"))  # short: stepd sockets live under it
        self.conf_path = d / "slurm.conf"
        self.cpus = cpus or len(os.sched_getaffinity(0))  # what `nproc` prints
        self.nodes = ["localhost"] if nodes == 1 else [f"node{i}" for i in range(1, nodes + 1)]
        settings = dict(
            ClusterName="mttest", SlurmctldHost="localhost", SlurmctldPort=str(_free_port()),
            SlurmUser="root", SlurmdUser="root", AuthType="auth/none", CredType="cred/none",
            CommunicationParameters="NoCtldInAddrAny,NoInAddrAny",
            ProctrackType="proctrack/linuxproc", TaskPlugin="task/none", MpiDefault="none",
            SchedulerType="sched/backfill", SelectType="select/cons_tres", SelectTypeParameters="CR_Core",
            ReturnToService="2", SlurmdParameters="config_overrides", MailProg="/bin/true",
            JobAcctGatherType="jobacct_gather/none", AccountingStorageType="accounting_storage/none",
            JobCompType="jobcomp/filetxt", JobCompLoc=str(d / "jobcomp.txt"), KillWait="10", MinJobAge="300",
            StateSaveLocation=str(d / "state"), SlurmdSpoolDir=str(d / "spool-%n"),
            SlurmctldPidFile=str(d / "slurmctld.pid"), SlurmdPidFile=str(d / "slurmd-%n.pid"),
            SlurmctldLogFile=str(d / "slurmctld.log"), SlurmdLogFile=str(d / "slurmd-%n.log"),
            SlurmctldDebug="info", SlurmdDebug="info", PlugStackConfig=str(d / "plugstack.conf"),
            SchedulerParameters="sched_interval=1,bf_interval=1", AuthInfo="cred_expire=5",
            FirstJobId=str(first_job_id()),
        )
        settings.update(conf)
        lines = [f"{k}={v}" for k, v in settings.items()]
        lines += [f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={_free_port()} CPUs={self.cpus}"
                  for n in self.nodes]
        lines.append(f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE "
                     "State=UP OverSubscribe=YES")
        for sub in ["state"] + [f"spool-{n}" for n in self.nodes]:
            (d / sub).mkdir()
        (d / "plugstack.conf").write_text("")  # keeps /etc/slurm/plugstack.conf out
        self.conf_path.write_text("\n".join(lines) + "\n")
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(_OUTER)}
        self.env["SLURM_CONF"] = str(self.conf_path)
        self.procs: dict[str, subprocess.Popen] = {}
        t0 = time.monotonic()
        try:
            daemons = [("slurmctld", ["-D", "-i"])] + [(f"slurmd-{n}", ["-D", "-N", n]) for n in self.nodes]
            for name, argv in daemons:
                with open(d / f"{name}.out", "wb") as out:
                    self.procs[name] = subprocess.Popen(
                        [shutil.which(name.split("-")[0], path=_PATH), *argv], env=self.env,
                        stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            while self._run("sinfo", "-h", "-N", "-o", "%t", check=False).split() != ["idle"] * len(self.nodes):
                dead = [n for n, p in self.procs.items() if p.poll() is not None]
                if dead or time.monotonic() - t0 > start_timeout:
                    raise RuntimeError(f"Slurm test cluster did not come up ({dead or 'timeout'}):\n"
                                       + self.logs_tail())
                time.sleep(0.2)
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - t0

    def _run(self, *argv: str, check: bool = True) -> str:
        r = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=30)
        if check and r.returncode:
            raise RuntimeError(f"{' '.join(argv)} -> {r.returncode}: {r.stderr.strip()}")
        return r.stdout.strip()

    def sbatch(self, args: list[str], cwd: str | os.PathLike | None = None) -> int:
        r = subprocess.run(["sbatch", *args], env=self.env, cwd=cwd, capture_output=True, text=True, timeout=30)
        m = re.search(r"Submitted batch job (\d+)", r.stdout)
        if r.returncode or not m:
            raise RuntimeError(f"sbatch {args} -> {r.returncode}: {r.stdout}{r.stderr}")
        return int(m.group(1))

    def job_info(self, job_id: int) -> dict[str, str]:
        """scontrol's fields (JobState, ExitCode "rc:sig", StdOut, ...), else the jobcomp record."""
        out = self._run("scontrol", "show", "job", "-o", str(job_id), check=False)
        if "JobState=" in out:
            return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)
        out = self._run("sacct", "-c", "-n", "-P", "-j", str(job_id), "-o", "jobid,state,exitcode", check=False)
        for jid, state, code in (line.split("|") for line in out.splitlines()):
            if jid == str(job_id):
                return {"JobId": jid, "JobState": state.split()[0], "ExitCode": code}
        return {}

    def wait_state(self, job_id: int, states=TERMINAL, timeout: float = 30.0) -> dict[str, str]:
        """Poll until JobState is in states; TimeoutError (with squeue and logs) otherwise."""
        states = (states,) if isinstance(states, str) else tuple(states)
        deadline = time.monotonic() + timeout
        while (info := self.job_info(job_id)).get("JobState") not in states:
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} not in {states} after {timeout}s: {info}\n"
                                   + "\n".join(self.squeue_lines()) + "\n" + self.logs_tail())
            time.sleep(0.2)
        return info

    def squeue_lines(self) -> list[str]:
        return self._run("squeue", "-h", "-o", "%i %T %j %R", check=False).splitlines()

    def scancel(self, job_id: int, signal: str | None = None, *extra: str) -> None:
        """scancel [--signal=SIG] [extra, e.g. "--full" or "--batch"] JOBID."""
        self._run("scancel", *([f"--signal={signal}"] if signal else []), *extra, str(job_id))

    def log(self, name: str) -> str:
        """A file in the cluster dir: slurmctld.log, slurmd-<node>.log, <daemon>.out, jobcomp.txt."""
        p = self.dir / name
        return p.read_text(errors="replace") if p.exists() else ""

    def logs_tail(self, chars: int = 1500) -> str:
        names = ["slurmctld.log"] + [f"slurmd-{n}.log" for n in self.nodes]
        return "".join(f"--- {n}\n{self.log(n)[-chars:]}" for n in names)

    def _ours(self) -> list[int]:
        """PIDs (other than this process) whose environment carries our SLURM_CONF."""
        needle, pids = f"\0SLURM_CONF={self.conf_path}\0".encode(), []
        for p in Path("/proc").iterdir():
            if p.name.isdigit() and int(p.name) != os.getpid():
                try:
                    if needle in b"\0" + (p / "environ").read_bytes() + b"\0":
                        pids.append(int(p.name))
                except OSError:
                    pass
        return pids

    def stop(self, timeout: float = 15.0) -> None:
        """Stop the daemons by PID (TERM, then KILL), then our strays (TERM, 2 s, KILL); remove the dir.

        Jobs are not scancel'ed first: Slurm ends every job with TERM, KillWait, KILL, which
        costs KillWait seconds whenever a task ignores TERM. SLURM_TEST_KEEP=1 in the
        environment keeps the dir (logs, jobcomp.txt) for a post-mortem."""
        for p in reversed(self.procs.values()):  # slurmds first, slurmctld last
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        for sig, grace in ((SIGTERM, 2.0), (SIGKILL, 5.0)):  # slurmstepds, batch scripts, tasks
            for pid in self._ours():
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + grace
            while self._ours() and time.monotonic() < deadline:
                time.sleep(0.1)
        self.procs.clear()
        if os.environ.get("SLURM_TEST_KEEP"):
            print(f"Slurm test cluster files kept in {self.dir}")
        else:
            shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def slurm():
    """A running one-node SlurmCluster for the test module; skipped (with the reason) where impossible."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    cluster = SlurmCluster()
    try:
        yield cluster
    finally:
        cluster.stop()
