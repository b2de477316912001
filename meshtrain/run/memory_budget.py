"""What memory each device of this process has for a run, read when the run starts: the
budget the compiled step's peak is checked against (run/memory_check.py) and that
train.accum_gather="auto" chooses by (planner/accumulation.py).

  accelerator  its own memory: memory_stats()["bytes_limit"] (what XLA's allocator may
               take, already short of what CUDA and its libraries keep) less "bytes_in_use",
               the smallest over this process's devices
  CPU          the host's RAM, shared by every simulated device of every process on this
               host: available = MemAvailable (/proc/meminfo), or the cgroup's limit less
               its usage when that is lower (a Slurm job with --mem, a container); each
               device gets available / (devices in this process x processes on this host)

A peak fits when it is at most MARGIN x that: XLA's estimate leaves out what the process
holds beside the step (the runtime, the input pipeline, an async checkpoint's host copy,
fragmentation; on CPU, Python itself). The host's margin is the planner's `usable_memory`
(planner/hardware.py); an accelerator's bytes_limit already excludes the runtime.
"""

from __future__ import annotations

import dataclasses
import os
import socket

from meshtrain.errors import gib

MARGIN = {"cpu": 0.90, "accelerator": 0.95}  # share of the budget a peak may take (docstring)
MEMINFO = "/proc/meminfo"
CGROUP_ROOT = "/sys/fs/cgroup"


@dataclasses.dataclass(frozen=True)
class Budget:
    """What each device of this process may use, in bytes."""

    available: float   # on the host (CPU), or on the tightest device
    sharing: int       # devices that share `available`: all on this host (CPU), else 1
    margin: float
    where: str         # how `available` was found, for the message
    host: bool = True  # `available` is the host's RAM (simulated CPU devices)
    processes: int = 1  # processes on this host whose devices share it
    sharers: str = "simulated CPU devices"  # what shares a host's RAM, for the message

    @property
    def per_device(self) -> float:
        return self.available * self.margin / self.sharing


def host_available(meminfo: str = MEMINFO, cgroup_root: str = CGROUP_ROOT,
                   self_cgroup: str = "/proc/self/cgroup") -> tuple[float, str] | None:
    """(bytes this process may still take from the host's RAM, where that came from), or None."""
    try:
        with open(meminfo) as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        best = (float(fields["MemAvailable"].split()[0]) * 1024, "MemAvailable in /proc/meminfo")
    except (OSError, KeyError, ValueError):
        best = None
    for room, where in _cgroup_rooms(cgroup_root, self_cgroup):
        if best is None or room < best[0]:
            best = (room, where)
    return best


def _cgroup_rooms(root: str, self_cgroup: str):
    """(limit - usage, where) of this process's memory cgroup and its ancestors that have a limit."""
    try:
        with open(self_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2
            base, files = root, ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):  # v1
            base, files = os.path.join(root, "memory"), ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):
            d = os.path.join(base, *parts[:depth])
            try:
                limit = open(os.path.join(d, files[0])).read().strip()
                usage = float(open(os.path.join(d, files[1])).read().strip())
            except (OSError, ValueError):
                continue
            if limit != "max" and float(limit) < 2**60:  # v1 writes "no limit" as ~2^63
                yield float(limit) - usage, f"the memory cgroup's limit less its usage ({d})"


def device_budget(devices, processes_on_host: int = 1, host=None) -> Budget | None:
    """This process's devices' budget (module docstring); None when it cannot be known.
    `host()` reads the host's RAM (default `host_available`)."""
    devices = list(devices)
    if devices[0].platform == "cpu":
        found = (host or host_available)()
        if found is None:
            return None
        return Budget(found[0], len(devices) * processes_on_host, MARGIN["cpu"], found[1], host=True,
                      processes=processes_on_host)
    rooms = []
    for d in devices:
        stats = d.memory_stats() or {}
        if "bytes_limit" not in stats:
            return None
        rooms.append((stats["bytes_limit"] - stats.get("bytes_in_use", 0), d))
    room, d = min(rooms, key=lambda r: r[0])
    return Budget(room, 1, MARGIN["accelerator"], f"{d}: memory_stats() bytes_limit less bytes_in_use",
                  host=False, processes=processes_on_host)


def host_budget(devices_budget: Budget, host=None) -> Budget | None:
    """The host RAM budget of an accelerator's processes for what train.offload keeps
    there: every device this host drives shares it (`devices_budget`: local_budget's)."""
    import jax

    found = (host or host_available)()
    if found is None:
        return None
    processes = devices_budget.processes
    return Budget(found[0], len(jax.local_devices()) * processes, MARGIN["cpu"], found[1], host=True,
                  processes=processes, sharers="devices")


def local_budget() -> Budget | None:
    """`device_budget` of this process's devices, sharing the host with the processes the
    cluster puts on it."""
    import jax

    from meshtrain.cluster import distributed
    hosts = distributed.hosts()
    me = hosts[jax.process_index()] if jax.process_index() < len(hosts) else socket.gethostname()
    return device_budget(jax.local_devices(), max(hosts.count(me), 1))


def fits(peak: float, budget: Budget) -> bool:
    return peak <= budget.per_device


def arithmetic(peak: float, budget: Budget) -> str:
    """The sentence that shows why it does (not) fit."""
    if budget.host:
        among = f" ({budget.sharing // budget.processes} in each of {budget.processes} processes)" \
            if budget.processes > 1 else ""
        return (f"{budget.sharing} {budget.sharers}{among} share this host's RAM: {budget.sharing} x "
                f"{gib(peak)} = {gib(peak * budget.sharing)} against {gib(budget.available)} available "
                f"({budget.where}), of which the check allows {budget.margin:.0%}, "
                f"{gib(budget.available * budget.margin)}")
    return (f"{gib(peak)} against {gib(budget.available)} on the device ({budget.where}), of which "
            f"the check allows {budget.margin:.0%}, {gib(budget.per_device)}")
