"""Joining the processes of a run: rendezvous, JAX's runtime, the process table.

    launch = launch_lib.detect(flags, os.environ)   # one process, srun, or flags
    cluster = distributed.start(launch, cfg, flags)  # before the JAX backend starts
    ...                                              # devices, mesh, training
    cluster.leave(status, message)                   # tell the others how this one ended

One process needs none of this: `start` records the host and returns. Several
processes first meet through meshtrain's rendezvous (which admits only processes
that know the job's MESHTRAIN_SECRET, says who is missing when some never arrive,
and stops them all when one is lost), then start JAX's
runtime with the same addresses and timeouts, so every collective between them,
gloo on CPU or NCCL on GPU, can run.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time

from meshtrain.errors import UserError
from meshtrain.cluster import handshake
from meshtrain.cluster.launch import Launch
from meshtrain.cluster.rendezvous import Rendezvous


@dataclasses.dataclass
class Cluster:
    launch: Launch
    table: list[dict]              # per process: {"process", "host", "pid"}
    rendezvous: Rendezvous | None  # None for one process
    seconds: dict = dataclasses.field(default_factory=dict)  # {"rendezvous": s, "jax": s} of the start

    @property
    def hosts(self) -> list[str]:
        return [entry["host"] for entry in self.table]

    def leave(self, status: int, message: str = "") -> None:
        if self.rendezvous is not None:
            self.rendezvous.leave(status, message)

    def set_note(self, note) -> None:
        """`note()` is added to the message when another process is lost (what is safe on disk)."""
        if self.rendezvous is not None:
            self.rendezvous.note = note

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
    if d.init_timeout <= 0 or d.heartbeat_timeout <= 0:
        raise UserError(f"distributed.init_timeout={d.init_timeout} and distributed.heartbeat_timeout="
                        f"{d.heartbeat_timeout} must be positive (seconds).")
    if not launch.multiprocess:
        _current = Cluster(launch, [{"process": 0, "host": socket.gethostname(), "pid": os.getpid()}], None)
        return _current
    rendezvous = Rendezvous(launch.process_id, launch.num_processes, launch.rendezvous, bind_host=launch.bind_host,
                            init_timeout=d.init_timeout, heartbeat_timeout=d.heartbeat_timeout,
                            config={"config": cfg.to_dict(), "workdir": (flags or {}).get("workdir")},
                            secret=handshake.secret_from(os.environ))
    t0 = time.perf_counter()
    table = rendezvous.start()
    rendezvous.watch()
    t1 = time.perf_counter()
    import jax
    if not os.environ.get("JAX_CPU_COLLECTIVES_IMPLEMENTATION"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # the default; said for clarity
    # Everyone is here, so JAX's own start is quick. Its heartbeat stays a backstop,
    # well behind ours, which names the lost process.
    jax.distributed.initialize(
        launch.coordinator, launch.num_processes, launch.process_id,
        local_device_ids=list(launch.local_device_ids) if launch.local_device_ids else None,
        cluster_detection_method="deactivate", initialization_timeout=int(d.init_timeout),
        heartbeat_timeout_seconds=max(100, int(2 * d.heartbeat_timeout) + 10),
        coordinator_bind_address=launch.coordinator if launch.bind_host else None)
    _current = Cluster(launch, table, rendezvous,
                       {"rendezvous": t1 - t0, "jax runtime": time.perf_counter() - t1})
    return _current


def hosts() -> list[str]:
    """The host of each process: from the rendezvous, else this host for every process."""
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
