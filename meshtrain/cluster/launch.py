"""How this process was launched: one process, SLURM's srun, or explicit flags / variables.

`detect(flags, environ)` reads nothing but its arguments, so every cluster shape
(one process per node with all its GPUs, one per GPU, GPUs bound per task, a
batch shell without srun) is tested with a dict of variables:

    --coordinator=HOST:PORT --num_processes=N --process_id=I   (flags win)
    JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID   (the same, as variables)
    SLURM_* under srun                                           (detected)

Port. `HOST:PORT` is JAX's coordination service on process 0, the one port a job opens
for itself (beside its collectives' own: gloo on CPU, NCCL on GPUs). Under SLURM JAX's own
detection picks it (jax.distributed.initialize with cluster_detection_method="slurm"):
the first node of the step, port 61440 + job id mod 4096, or JAX_COORDINATOR_PORT.

GPUs per process under SLURM: a task alone on its node drives every visible GPU;
k tasks on a node that all see the same G GPUs split them, task l taking ordinals
[l G/k, (l+1) G/k); tasks that Slurm bound to their own GPUs (--gpus-per-task,
--gpu-bind) use what they see. JAX's own detection gives every task one GPU,
which is wrong for one process per node (jax-ml/jax#16788, maxtext#865).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
import shutil
import subprocess
from collections.abc import Mapping

from meshtrain.errors import UserError, shown

@dataclasses.dataclass(frozen=True)
class Launch:
    method: str                    # "single", "slurm", "flags" or "environment"
    num_processes: int = 1
    process_id: int = 0
    coordinator: str | None = None  # HOST:PORT of JAX's coordination service (SLURM: JAX's, after the start)
    local_device_ids: tuple[int, ...] | None = None  # GPU ordinals this process drives
    where: str = ""                # how it was detected, for the start-up log

    @property
    def multiprocess(self) -> bool:
        return self.num_processes > 1

    @property
    def bind_host(self) -> str | None:
        """Where process 0's ports listen: the coordinator's host when it is this machine's
        loopback (launch/local.sh's 127.0.0.1), so nothing off the machine reaches them;
        else None, every interface, as the job's other nodes must reach it."""
        if self.coordinator is None:
            return None
        host, _ = split_address(self.coordinator)
        return host if is_loopback(host) else None


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise UserError(f"Coordinator address {address!r} is not HOST:PORT, e.g. "
                        f"--coordinator=node001:61440.")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    """Whether `host` is written as a loopback address (127.x, ::1, localhost). A name is not
    resolved: on Debian-style hosts a node's own name maps to 127.0.1.1 locally while the
    other nodes reach it by its real address."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def expand_tasks_per_node(text: str) -> list[int]:
    """SLURM_STEP_TASKS_PER_NODE: "4(x2),3" -> [4, 4, 3]."""
    counts = []
    for part in text.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise UserError(f"Cannot read SLURM_STEP_TASKS_PER_NODE={text!r}.")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def _int(value, what: str) -> int:
    """A flag's or variable's integer; anything else (text, 10,000 digits) a UserError."""
    text = str(value).strip()
    if len(text) > 18 or not (text.isascii() and text.lstrip("-").isdigit()):
        raise UserError(f"{what} must be an integer, got {shown(value)}.")
    return int(text)


def detect(flags: Mapping[str, str], environ: Mapping[str, str]) -> Launch:
    """The launch of this process, from its flags and environment; misuse is a UserError."""
    given = {k: flags[k] for k in ("coordinator", "num_processes", "process_id") if k in flags}
    if given:
        return _explicit(given, "flags", "--{}", "flags")
    names = {"coordinator": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
             "process_id": "JAX_PROCESS_ID"}
    given = {k: environ[v] for k, v in names.items() if environ.get(v)}
    if given and (len(given) > 1 or "num_processes" in given):
        return _explicit(given, "environment", "{}", "variables", names)
    if "SLURM_JOB_ID" in environ:
        return _slurm(environ)
    return Launch("single", where="one process")


def _explicit(given: dict, method: str, spell: str, kind: str, names: dict | None = None) -> Launch:
    name = (lambda k: spell.format(names[k] if names else k))  # noqa: E731
    missing = [name(k) for k in ("coordinator", "num_processes", "process_id") if k not in given]
    if missing:
        raise UserError(
            f"A multi-process launch needs the coordinator address, the process count and this "
            f"process's id; the {kind} lack {', '.join(missing)}. Give all three, e.g. "
            f"--coordinator=HOST:PORT --num_processes=2 --process_id=0 (or use "
            f"launch/local.sh N CONFIG to start N local processes).")
    n = _int(given["num_processes"], name("num_processes"))
    i = _int(given["process_id"], name("process_id"))
    if n < 1 or not 0 <= i < n:
        raise UserError(f"{name('process_id')}={i} with {name('num_processes')}={n}: the id must be "
                        f"in 0..{n - 1}.")
    split_address(given["coordinator"])
    return Launch(method, n, i, given["coordinator"] if n > 1 else None,
                  where=f"{kind}: process {i} of {n}, coordinator {given['coordinator']}")


def _slurm(env: Mapping[str, str]) -> Launch:
    job = env["SLURM_JOB_ID"]
    tasks = _int(env.get("SLURM_NTASKS", "1"), "SLURM_NTASKS")
    nodes = _int(env.get("SLURM_JOB_NUM_NODES", env.get("SLURM_NNODES", "1")), "SLURM_JOB_NUM_NODES")
    if "SLURM_STEP_NODELIST" not in env or "SLURM_PROCID" not in env:
        # The batch shell of sbatch, or a shell of salloc: not a job step.
        if tasks > 1 or nodes > 1:
            raise UserError(
                f"This is SLURM job {job} with {tasks} task(s) on {nodes} node(s), but the trainer was "
                f"started outside srun, so it would train in one process on one node and leave the "
                f"rest idle. Start it with srun: `srun python -m meshtrain.train --config=...` "
                f"(launch/slurm.sbatch does this).")
        return Launch("single", where=f"one process in SLURM job {job} (outside srun)")
    rank = _int(env["SLURM_PROCID"], "SLURM_PROCID")
    where = f"SLURM job {job} step {env.get('SLURM_STEP_ID', '?')}"
    if tasks == 1:
        return Launch("single", where=f"one process, {where}")
    nodes = _int(env.get("SLURM_STEP_NUM_NODES", nodes), "SLURM_STEP_NUM_NODES")
    port = env.get("JAX_COORDINATOR_PORT", "")
    if port and not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        raise UserError(f"JAX_COORDINATOR_PORT={port!r} is not a port number (1-65535).")
    per_node = expand_tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE", str(tasks)))
    node_index = _int(env.get("SLURM_NODEID", "0"), "SLURM_NODEID")
    local_tasks = per_node[node_index] if node_index < len(per_node) else 1
    local_rank = _int(env.get("SLURM_LOCALID", "0"), "SLURM_LOCALID")
    ids = slurm_local_device_ids(env, local_tasks, local_rank)
    return Launch("slurm", tasks, rank, None, ids,
                  where=f"{where}: task {rank} of {tasks} on {nodes} node(s), {local_tasks} on this "
                        f"node ({env.get('SLURMD_NODENAME', f'node {node_index}')})")


def visible_gpus(env: Mapping[str, str]) -> int | None:
    """GPUs this process may see: CUDA_VISIBLE_DEVICES, else nvidia-smi's count, else None."""
    if "CUDA_VISIBLE_DEVICES" in env:
        return len([d for d in env["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()])
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return sum(line.startswith("GPU ") for line in out.splitlines()) or None


def slurm_local_device_ids(env: Mapping[str, str], local_tasks: int,
                           local_rank: int) -> tuple[int, ...] | None:
    """GPU ordinals for task `local_rank` of `local_tasks` on its node: every GPU it sees
    (0..G-1: JAX's Slurm detection would otherwise give each task one), its share, or None
    on a node without GPUs."""
    if env.get("JAX_LOCAL_DEVICE_IDS"):
        return tuple(_int(x, "JAX_LOCAL_DEVICE_IDS") for x in env["JAX_LOCAL_DEVICE_IDS"].split(","))
    gpus = visible_gpus(env)
    if not gpus:
        return None  # a CPU node: simulated devices, nothing to split
    bound = env.get("SLURM_GPUS_PER_TASK") or "per_task" in env.get("SLURM_GPU_BIND", "")
    if local_tasks == 1 or bound or gpus < local_tasks:
        return tuple(range(gpus))  # all it sees: alone on the node, or Slurm bound each task its own
    if gpus % local_tasks:
        raise UserError(
            f"{local_tasks} SLURM tasks on this node share {gpus} visible GPUs, which do not split "
            f"evenly ({gpus} / {local_tasks}). Use --ntasks-per-node=1 (one process drives every "
            f"GPU) or --ntasks-per-node={gpus} (one per GPU), or bind GPUs with --gpus-per-task.")
    k = gpus // local_tasks
    return tuple(range(local_rank * k, (local_rank + 1) * k))
