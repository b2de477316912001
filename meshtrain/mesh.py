"""The device mesh: six named axes in a fixed order, sized by config, laid over nodes.

Every mesh has the axes
`AXES = ("data", "stage", "fsdp", "context", "expert", "tensor")`, slowest link first,
with size 1 where unused, so PartitionSpecs read the same on any mesh. `context` (a
sequence's positions split over devices, docs/layouts.md "Long sequences") sits after
fsdp: every layer's attention passes keys and values over it, forward and backward (a
ring's permutes or an all-gather), more than fsdp's once-per-layer weight gathers at
long sequence. `expert` (a mixture of experts' experts split over devices) comes next:
each MoE layer's dispatch and combine all-to-alls move k x tokens x embed elements
each way (k experts per token), forward and backward, more than context's keys and
values (grouped-query attention sends kv_heads x head_dim << embed per position). Both
want a fast link, but neither blocks every matmul as tensor's all-reduces do, so both
yield the fastest link to tensor.

  parse_shape("data:8,tensor:4")  -> all six axes; one size may be -1
  resolve_shape(shape, n, why=)   fills the -1 from n devices and checks the product;
                                  a mismatch is a UserError that shows the arithmetic
  format_shape, format_factors    the shape back as text (all axes / axes above 1)

Device count. On a CPU-only host the count is whatever the mesh needs:
`simulate_cpu_devices(shape, processes)` sets each process's share before JAX starts
its backend (after `jax.distributed.initialize` when there are several processes) and
returns (global count, where it came from). The count is fixed, and only reported, on
accelerators, when the CPU count was pinned (JAX_NUM_CPU_DEVICES, XLA_FLAGS,
jax.config) or when the backend has already started. A -1 axis with nothing to fill it
from (a simulated count) is an error.

Nodes. `mesh.dcn` gives each axis's inter-node (DCN) factor: `parse_dcn` reads and checks
it, `dcn_warnings` flags tensor, context or expert parallelism across nodes (a run prints
the linter's findings of the same, planner/lint.py). `granules` says which node each device
is on (hosts, else processes standing in for nodes, else equal runs of one process's
devices), and `nodes_of` maps every device id to its node. `hybrid_grid` arranges the
devices so that each axis is DCN x ICI, node outermost, with every ICI factor inside one
node.

`make_mesh(shape, devices, dcn, hosts)` builds the `jax.sharding.Mesh`, every axis
`AxisType.Auto`, on the hybrid grid when there is a DCN factor.
"""

from __future__ import annotations

import math
import os
import re
import socket
from collections.abc import Mapping, Sequence

from typing import TYPE_CHECKING

import numpy as np

from meshtrain.errors import UserError

# jax is imported where it is used: the commands parse their flags and answer --help
# without starting it (a second saved on every `meshtrain COMMAND --help`).
if TYPE_CHECKING:
    import jax
    from jax.sharding import Mesh

AXES = ("data", "stage", "fsdp", "context", "expert", "tensor")


def parse_shape(spec: str | Mapping[str, int]) -> dict[str, int]:
    """`"data:8,tensor:4"` -> {"data": 8, "stage": 1, "fsdp": 1, "context": 1, "expert": 1,
    "tensor": 4}.

    At most one axis may be -1 (filled later by `resolve_shape`).
    """
    if isinstance(spec, Mapping):
        items = [(str(k), v) for k, v in spec.items()]
    else:
        items = []
        for part in filter(None, (p.strip() for p in str(spec).split(","))):
            name, sep, size = part.partition(":")
            if not sep or not re.fullmatch(r"-?\d+", size.strip()):
                raise UserError(
                    f"Mesh shape {spec!r}: the entry {part!r} is not 'axis:size'. "
                    f"Write the mesh as comma-separated 'axis:size' pairs over the axes "
                    f"{', '.join(AXES)}, e.g. 'data:8,tensor:4' (one size may be -1).")
            items.append((name.strip(), int(size)))
    shape = dict.fromkeys(AXES, 1)
    seen = set()
    for name, size in items:
        if name not in AXES:
            raise UserError(
                f"Mesh shape {spec!r}: unknown axis {name!r}. The mesh axes are "
                f"{', '.join(AXES)} (in that order, slowest link first); "
                f"e.g. 'data:8,tensor:4'.")
        if name in seen:
            raise UserError(f"Mesh shape {spec!r}: axis {name!r} is given twice.")
        if not isinstance(size, int) or (size < 1 and size != -1):
            raise UserError(
                f"Mesh shape {spec!r}: axis {name!r} has size {size}; sizes are "
                f"positive integers, or -1 for one axis to fill the device count.")
        seen.add(name)
        shape[name] = size
    if sum(s == -1 for s in shape.values()) > 1:
        raise UserError(f"Mesh shape {spec!r}: only one axis may be -1.")
    return shape


def format_shape(shape: Mapping[str, int]) -> str:
    """{"data": 8, "stage": 1, ...} -> "data:8,stage:1,fsdp:1,context:1,expert:1,tensor:4"."""
    return ",".join(f"{a}:{shape[a]}" for a in AXES)


def format_factors(shape: Mapping[str, int]) -> str:
    """Only the axes above 1: {"data": 2, "tensor": 1, ...} -> "data:2"."""
    return ",".join(f"{a}:{shape[a]}" for a in AXES if shape[a] != 1) or "1"


def resolve_shape(shape: Mapping[str, int], num_devices: int, *, why: str = "") -> dict[str, int]:
    """Fills a -1 axis and checks that the product equals `num_devices`.

    `why` says where the device count comes from, for the error message.
    """
    shape = dict(shape)
    known = math.prod(s for s in shape.values() if s != -1)
    where = f" ({why})" if why else ""
    free = [a for a, s in shape.items() if s == -1]
    if free:
        if num_devices % known:
            raise UserError(
                f"Mesh {format_shape(shape)}: the fixed axes multiply to {known}, which "
                f"does not divide the {num_devices} available devices{where}, so "
                f"{free[0]}=-1 cannot be filled. Choose sizes whose product divides "
                f"{num_devices}.")
        shape[free[0]] = num_devices // known
    total = math.prod(shape.values())
    if total != num_devices:
        arithmetic = " x ".join(str(shape[a]) for a in AXES)
        relation = "more" if total > num_devices else "fewer"
        raise UserError(
            f"Mesh {format_shape(shape)} needs {arithmetic} = {total} devices, "
            f"{relation} than the {num_devices} available{where}. Change mesh.shape so "
            f"the sizes multiply to {num_devices} (one axis may be -1 to fill the "
            f"count), or run with {total} devices.")
    return shape


def _pinned_cpu_count() -> int | None:
    """The CPU device count the user fixed before we could choose it, if any."""
    import jax

    if jax.config.jax_num_cpu_devices not in (None, -1):
        return int(jax.config.jax_num_cpu_devices)
    if os.environ.get("JAX_NUM_CPU_DEVICES"):
        return int(os.environ["JAX_NUM_CPU_DEVICES"])
    flag = re.search(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
    return int(flag.group(1)) if flag else None


def _backend_started() -> bool:
    from jax._src import xla_bridge  # no public query for this; stable since 0.4
    return xla_bridge.backends_are_initialized()


def _has_accelerator_plugin() -> bool:
    """Whether a GPU/TPU PJRT plugin is installed (checked without starting a backend)."""
    import importlib.util
    return any(importlib.util.find_spec(m) is not None
               for m in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm_plugin", "libtpu"))


def simulate_cpu_devices(shape: Mapping[str, int], processes: int = 1) -> tuple[int, str]:
    """Makes the device count match `shape` on a CPU-only host; returns (global count, source).

    Must run before the JAX backend starts (after `jax.distributed.initialize` when
    there are several processes: each then simulates its share of the mesh). On
    accelerators, or when the CPU count was pinned, it changes nothing and returns
    the fixed count and why it is fixed.
    """
    import jax

    want = math.prod(s for s in shape.values() if s != -1)
    if _backend_started():
        return jax.device_count(), "devices already initialised in this process"
    pinned = _pinned_cpu_count()
    if pinned is None and -1 in shape.values() and not _has_accelerator_plugin():
        raise UserError(
            f"Mesh {format_shape(shape)} has an axis of size -1, but on a CPU-only host the "
            f"device count is simulated to fit the mesh, so there is nothing to fill it from. "
            f"Give every axis a size, or pin the count, e.g. JAX_NUM_CPU_DEVICES=8.")
    if pinned is None:
        if want % processes == 0:
            jax.config.update("jax_num_cpu_devices", want // processes)
        elif not _has_accelerator_plugin():
            raise UserError(
                f"Mesh {format_shape(shape)} needs {want} devices, which {processes} processes "
                f"cannot share evenly ({want} / {processes}). Use a process count that divides "
                f"{want}, or change mesh.shape.")
    devices = jax.devices()
    if processes > 1:
        each = f"{processes} processes x {jax.local_device_count()}"
        if devices[0].platform != "cpu":
            return len(devices), f"{each} {devices[0].platform} devices"
        if pinned is not None:
            return len(devices), f"{each} CPU devices, count pinned by JAX_NUM_CPU_DEVICES or XLA_FLAGS"
        return len(devices), f"{each} simulated CPU devices"
    if devices[0].platform != "cpu":
        return len(devices), f"{devices[0].platform} devices on this host"
    if pinned is not None:
        return len(devices), "CPU device count pinned by JAX_NUM_CPU_DEVICES or XLA_FLAGS"
    return len(devices), "simulated CPU devices"


def parse_dcn(spec: str, shape: Mapping[str, int]) -> dict[str, int] | None:
    """`mesh.dcn` ("data:2") -> the inter-node factor of every axis, checked against `shape`.

    None when there is no DCN factor. Each factor must divide its axis; the rest of
    the axis (its ICI factor) stays inside a node.
    """
    if not spec:
        return None
    dcn = parse_shape(spec)
    if -1 in dcn.values():
        raise UserError(f"mesh.dcn={spec!r}: DCN factors are node counts and cannot be -1.")
    for axis in AXES:
        if shape[axis] % dcn[axis]:
            raise UserError(
                f"mesh.dcn={spec!r} puts {dcn[axis]} nodes on axis {axis!r}, but the mesh gives that "
                f"axis {shape[axis]} devices ({format_shape(shape)}), which {dcn[axis]} does not "
                f"divide. Each DCN factor must divide its axis: the axis is DCN x ICI, nodes x "
                f"devices per node.")
    return dcn if math.prod(dcn.values()) > 1 else None


def dcn_warnings(dcn: Mapping[str, int] | None) -> list[str]:
    """Placements that send heavy traffic over the slow inter-node links."""
    out = []
    if dcn and dcn["tensor"] > 1:
        out.append(f"mesh.dcn puts the tensor axis across {dcn['tensor']} nodes: tensor parallelism "
                   f"all-reduces activations in every layer, forward and backward, and is the one "
                   f"layout that should stay inside a node. Put data (or fsdp, or stage) on DCN instead.")
    if dcn and dcn["context"] > 1:
        out.append(f"mesh.dcn puts the context axis across {dcn['context']} nodes: context parallelism "
                   f"passes every layer's keys and values between the devices of a sequence, "
                   f"forward and backward. Keep context inside a node and put data (or fsdp) on DCN.")
    if dcn and dcn["expert"] > 1:
        out.append(f"mesh.dcn puts the expert axis across {dcn['expert']} nodes: every MoE layer's "
                   f"dispatch and combine all-to-alls send each token's embedding to its experts and "
                   f"back, forward and backward, so they would cross nodes. Keep expert inside a node "
                   f"and put data (or fsdp) on DCN.")
    return out


def granules(devices: Sequence[jax.Device], count: int, hosts: Sequence[str]) -> tuple[list[int], str]:
    """The node ("granule") of each device, for `count` nodes, and how they were found.

    Nodes are hosts when there are `count` of them; else processes, when there are
    `count` (several processes on one machine rehearsing a cluster); else, in one
    process, `count` equal runs of its devices (a laptop trying a cluster layout).
    `hosts[p]` is the host of process p.
    """
    distinct = list(dict.fromkeys(hosts))
    if len(distinct) == count:
        return [distinct.index(hosts[d.process_index]) for d in devices], f"{count} hosts"
    if len(hosts) == count:
        return ([d.process_index for d in devices],
                f"{count} processes on {len(distinct)} host(s), each standing in for a node")
    if len(hosts) == 1 and len(devices) % count == 0:
        per = len(devices) // count
        return [k // per for k in range(len(devices))], f"simulated: {count} groups of {per} devices in one process"
    raise UserError(
        f"mesh.dcn spans {count} nodes (the product of its factors), but this run has "
        f"{len(hosts)} process(es) on {len(distinct)} host(s). Make the DCN factors multiply to "
        f"the number of nodes ({len(distinct)}), or leave mesh.dcn empty on one node.")


def nodes_of(devices: Sequence[jax.Device], dcn: Mapping[str, int] | None,
             hosts: Sequence[str]) -> tuple[dict[int, int], str]:
    """{device id: node} and how the nodes were found: `granules` under `dcn`, else hosts."""
    if dcn:
        of, how = granules(devices, math.prod(dcn.values()), hosts)
        return {d.id: g for d, g in zip(devices, of)}, how
    distinct = list(dict.fromkeys(hosts))
    return {d.id: distinct.index(hosts[d.process_index]) for d in devices}, f"{len(distinct)} host(s)"


def hybrid_grid(shape: Mapping[str, int], dcn: Mapping[str, int], devices: Sequence[jax.Device],
                hosts: Sequence[str]) -> tuple[np.ndarray, str]:
    """Devices arranged as AXES ([data, stage, fsdp, context, expert, tensor]) with each axis split
    DCN x ICI: position k along an axis is node k // ici, device k % ici within the node. Returns
    (grid, how the nodes were found)."""
    dcn_sizes = [dcn[a] for a in AXES]
    ici_sizes = [shape[a] // dcn[a] for a in AXES]
    count, per = math.prod(dcn_sizes), math.prod(ici_sizes)
    of, how = granules(devices, count, hosts)
    groups = [sorted((d for d, g in zip(devices, of) if g == k), key=lambda d: d.id) for k in range(count)]
    sizes = sorted({len(g) for g in groups})
    if sizes != [per]:
        ici = format_factors(dict(zip(AXES, ici_sizes)))
        raise UserError(
            f"Mesh {format_shape(shape)} with mesh.dcn={format_factors(dcn)} needs {per} devices in "
            f"each of {count} nodes (ICI {ici}: {' x '.join(map(str, ici_sizes))} = {per}), but the "
            f"nodes ({how}) have {' or '.join(map(str, sizes))} devices each. Choose ICI factors "
            f"that multiply to the devices of one node.")
    grid = np.empty((count, per), dtype=object)
    for k, group in enumerate(groups):
        grid[k] = group
    # [dcn..., ici...] -> interleave each axis's (dcn, ici) pair -> merge each pair.
    n = len(AXES)
    grid = grid.reshape(dcn_sizes + ici_sizes).transpose([i for a in range(n) for i in (a, n + a)])
    return grid.reshape([shape[a] for a in AXES]), how


def make_mesh(shape: Mapping[str, int], devices: Sequence[jax.Device] | None = None,
              dcn: Mapping[str, int] | None = None, hosts: Sequence[str] | None = None) -> Mesh:
    """A Mesh with axes AXES in Auto mode (XLA propagates shardings).

    `dcn` gives the inter-node factor of each axis (`parse_dcn`): the axis size is
    then DCN x ICI, with the slow DCN factor outermost, and every ICI factor inside
    one node. `hosts[p]` is the host of process p (default: this host for all).
    """
    import jax
    from jax.sharding import AxisType, Mesh

    sizes = tuple(shape[a] for a in AXES)
    auto = (AxisType.Auto,) * len(AXES)
    if dcn and math.prod(dcn.values()) > 1:
        devices = list(devices if devices is not None else jax.devices())
        hosts = list(hosts) if hosts is not None else [socket.gethostname()] * jax.process_count()
        return Mesh(hybrid_grid(shape, dcn, devices, hosts)[0], AXES, axis_types=auto)
    if devices is not None:
        return Mesh(np.asarray(devices).reshape(sizes), AXES, axis_types=auto)
    return jax.make_mesh(sizes, AXES, axis_types=auto)
