"""Joining the processes of a run: JAX's runtime, the start agreement, liveness.

    launch = launch_lib.detect(flags, os.environ)   # one process, srun, or flags
    cluster = distributed.start(launch, cfg, flags)  # before the JAX backend starts
    ...                                              # devices, mesh, training
    cluster.leave(status, message)                   # tell the others how this one ended

One process needs none of this: `start` records the host and returns. Several processes
start JAX's runtime (jax.distributed.initialize: process 0 hosts its coordination
service, on the one port the job opens for itself), agree that they are one job
(agreement.py) and watch each other (liveness.py), all through that service. JAX's
recoverability is on, so a lost process does not abort the others from inside JAX:
they name it, and stop.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import threading
import time

from meshtrain.errors import RunFailed, UserError
from meshtrain.cluster import agreement, kv
from meshtrain.cluster.launch import Launch
from meshtrain.cluster.liveness import Liveness


@dataclasses.dataclass
class Cluster:
    launch: Launch
    table: list[dict]              # per process: {"process", "host", "pid"}
    liveness: Liveness | None      # None for one process
    seconds: dict = dataclasses.field(default_factory=dict)  # {"jax runtime": s, "agreement": s} of the start
    end_timeout: float = 300.0     # s the first process done waits for the last (distributed.init_timeout)

    @property
    def hosts(self) -> list[str]:
        return [entry["host"] for entry in self.table]

    def leave(self, status: int, message: str = "") -> None:
        if self.liveness is not None:
            self.liveness.leave(status, message, self.end_timeout)

    def settle(self) -> None:
        """Before reporting an error: a peer lost meanwhile is named instead (Liveness.settle)."""
        if self.liveness is not None:
            self.liveness.settle()

    def set_note(self, note) -> None:
        """`note()` is added to the message when another process is lost (what is safe on disk)."""
        if self.liveness is not None:
            self.liveness.note = note

    def describe(self) -> list[str]:
        """Start-up lines: how the processes were launched and which devices each drives."""
        import jax
        by_process = _device_ids()
        n = self.launch.num_processes
        took = "; joined in " + ", ".join(f"{v:.1f} s ({k})" for k, v in self.seconds.items()) if self.seconds else ""
        lines = [f"processes: {n} ({self.launch.where}); {jax.device_count()} devices, "
                 f"{jax.local_device_count()} in this process{took}"]
        shown = self.table if n <= 8 else self.table[:4] + self.table[-2:]
        for entry in shown:
            if n > 8 and entry is self.table[-2]:
                lines.append(f"  ... {n - 6} more processes (all in run.json)")
            ids = by_process.get(entry["process"], [])
            lines.append(f"  process {entry['process']}: host {entry['host']}, pid {entry['pid']}, "
                         f"devices {id_ranges(ids)}")
        return lines

    def info(self) -> dict:
        """The run.json record of the processes."""
        ids = _device_ids()
        return {"method": self.launch.method, "where": self.launch.where, "start_seconds": self.seconds,
                "coordinator": self.launch.coordinator, "num_processes": self.launch.num_processes,
                "processes": [{**e, "devices": ids.get(e["process"], [])} for e in self.table]}


def _device_ids() -> dict[int, list[int]]:
    """{process index: ids of its devices}."""
    import jax
    ids: dict[int, list[int]] = {}
    for d in jax.devices():
        ids.setdefault(d.process_index, []).append(d.id)
    return ids


_current: Cluster | None = None  # like jax.distributed's own global state: one per process


def start(launch: Launch, cfg, flags: dict | None = None) -> Cluster:
    """Joins the other processes (if any) and starts JAX's runtime; call before any device use."""
    global _current
    d = cfg.distributed
    if d.init_timeout <= 0:
        raise UserError(f"distributed.init_timeout={d.init_timeout} must be positive (seconds).")
    if d.heartbeat_timeout < 1:
        raise UserError(f"distributed.heartbeat_timeout={d.heartbeat_timeout} must be at least 1 (seconds; "
                        f"JAX's heartbeat counts whole seconds).")
    me = {"process": launch.process_id, "host": socket.gethostname(), "pid": os.getpid()}
    if not launch.multiprocess:
        _current = Cluster(launch, [me], None)
        return _current
    import jax
    if not os.environ.get("JAX_CPU_COLLECTIVES_IMPLEMENTATION"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # the default; said for clarity
    jax.config.update("jax_enable_recoverability", True)  # a lost process is ours to name (liveness.py)
    t0 = time.perf_counter()
    late = _say_if_late(launch, d.init_timeout)
    slurm = launch.method == "slurm"  # JAX's own Slurm detection finds process 0's host and port
    jax.distributed.initialize(
        launch.coordinator, launch.num_processes, launch.process_id,
        local_device_ids=list(launch.local_device_ids) if launch.local_device_ids else None,
        cluster_detection_method="slurm" if slurm else "deactivate", initialization_timeout=int(d.init_timeout),
        heartbeat_timeout_seconds=max(1, round(d.heartbeat_timeout)),
        coordinator_bind_address=launch.coordinator if launch.bind_host else None)
    late.cancel()
    if slurm:
        from jax._src import distributed as jax_distributed
        launch = dataclasses.replace(launch, coordinator=jax_distributed.global_state.coordinator_address)
    t1 = time.perf_counter()
    store = kv.Store()
    config = {"config": cfg.to_dict(), "workdir": (flags or {}).get("workdir")}
    try:
        table = agreement.agree(store, me, launch.num_processes, config, d.init_timeout)
    except RunFailed:
        store.part(launch.process_id, launch.num_processes, timeout_s=10)  # all read the verdict
        raise
    liveness = Liveness(store, table, launch.process_id, d.heartbeat_timeout).watch()
    if launch.process_id != 0:  # said now: JAX's abort, should it come, leaves no room for it
        print(f"meshtrain: process {launch.process_id} of {launch.num_processes} joined; process 0 "
              f"(host {table[0]['host']}, pid {table[0]['pid']}) hosts JAX's coordination service at "
              f"{launch.coordinator}: should process 0 be lost, JAX ends this process at once with "
              f"'Terminating process because the JAX distributed service detected fatal errors'.",
              file=sys.stderr, flush=True)
    _current = Cluster(launch, table, liveness, {"jax runtime": t1 - t0, "agreement": time.perf_counter() - t1},
                       end_timeout=d.init_timeout)
    return _current


def _say_if_late(launch: Launch, timeout_s: float) -> threading.Timer:
    """JAX aborts the start with a C++ trace and no names when not every process joins in
    time: this says first what happened, and what to check."""
    n = launch.num_processes
    address = launch.coordinator or "the first node of the step, JAX's Slurm port"

    def say():
        print(f"meshtrain: error: not all {n} processes joined JAX's coordination service at {address} "
              f"(process 0's host) within {timeout_s:g} s (distributed.init_timeout); JAX stops this "
              f"process next, with its own 'Terminating process' message. The log of a missing "
              f"process says why it did not come. Check that every process was started with "
              f"--num_processes={n} and its own id, that {address} is process 0's host and port and "
              f"reachable from every node (and not held by another job), or raise "
              f"distributed.init_timeout if they start slowly.", file=sys.stderr, flush=True)

    timer = threading.Timer(timeout_s, say)
    timer.daemon = True
    timer.start()
    return timer


def hosts() -> list[str]:
    """The host of each process: from the start agreement, else this host for every process."""
    if _current is not None:
        return _current.hosts
    import jax
    return [socket.gethostname()] * jax.process_count()


def id_ranges(ids: list[int]) -> str:
    """[0, 1, 2, 3, 8] -> "0-3, 8"."""
    out, ids = [], sorted(ids)
    for i in ids:
        if out and i == out[-1][1] + 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in out) or "none"
