"""What a compiled program communicates: collectives per step, loops counted.

`compiled.as_text()` is the per-device program after SPMD partitioning. A
collective inside a `while` body (a `lax.scan`) appears once in the text but runs
once per iteration, so each computation is weighted by how often it runs: the
product of the `known_trip_count`s of the loops around it.

    stats = collectives(exp.compile())
    stats["all-gather"]  # Collective(count=executions per step, bytes=result bytes, wire=...)

Matmul and conv FLOPs, counted the same way, are planner/hlo_flops.py's.

A `conditional` (lax.cond) runs one of its branches per execution: dot_flops counts its
costliest branch (the device that takes it sets the step's pace; the load-balanced ring
of parallel/context_attention.py has equal branches, which `conditionals` shows). The
collectives count every branch's (none of this package's conditionals holds one).

Bytes are counted as an accelerator would send them, where the CPU compiler differs:
  - it widens 16-bit collectives to float32, reductions by XLA's all-reduce promotion (the
    reducer is renamed `*_promoted`), the others by float normalization (a convert from
    bf16 feeds them): such an op is counted at its 16-bit size;
  - it all-reduces pieces that are then only added (the two uses of a tied embedding, the
    input gradients of projections that read the same activation) one by one, where XLA's
    GPU pipeline reassociates them into one all-reduce: same-shape pieces of a combined
    all-reduce whose only consumer is one instruction count once.

`wire` is the ring-algorithm bytes each device sends: all-reduce 2(n-1)/n x S,
all-gather and all-to-all (n-1)/n x S (S = result), reduce-scatter (n-1) x S
(S = result = input / n), for a group of n devices; collective-permute S times
the share of devices that send (every device runs the op; some only receive).
"""

from __future__ import annotations

import collections
import dataclasses
import re

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
               "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}

_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) .*\{\s*$")
INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*)$")  # name, the rest
SHAPE = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_CALLED = re.compile(r"\b(body|condition|calls|to_apply|branch_computations|true_computation|false_computation)=\{?(%[^,}\s]+(?:,\s*%[^,}\s]+)*)\}?")
_PROMOTED = re.compile(r"to_apply=%\S*_promoted\b")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


@dataclasses.dataclass
class Collective:
    count: int = 0      # executions per step
    bytes: int = 0      # result bytes per step, summed over executions
    wire: float = 0.0   # bytes sent per device per step (ring algorithms)


def shape_bytes(text: str) -> int:
    """Bytes of an HLO shape, e.g. `f32[4,128]{1,0}` or a tuple `(f32[2], bf16[3,3])`."""
    total = 0
    for dtype, dims in SHAPE.findall(text):
        if dtype in DTYPE_BYTES:
            n = 1
            for d in filter(None, dims.split(",")):
                n *= int(d)
            total += n * DTYPE_BYTES[dtype]
    return total


def _senders(attrs: str, devices: int) -> float:
    """Share of the devices that send in a collective-permute."""
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", attrs)
    pairs = len(re.findall(r"\{\d+,\d+", m.group(1) + "}")) if m else devices
    return min(1.0, pairs / max(devices, 1))


def wire_bytes(kind: str, nbytes: int, n: int) -> float:
    if kind == "all-reduce":
        return 2 * (n - 1) / n * nbytes
    if kind in ("all-gather", "all-to-all"):
        return (n - 1) / n * nbytes
    if kind == "reduce-scatter":
        return (n - 1) * nbytes
    return float(nbytes)  # collective-permute


def computations(text: str) -> tuple[dict[str, list[str]], str]:
    comps: dict[str, list[str]] = {}
    entry, current = "", None
    for line in text.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            current = m.group(1)
            comps[current] = []
            if line.startswith("ENTRY"):
                entry = current
        elif current is not None and line.strip() == "}":
            current = None
        elif current is not None:
            comps[current].append(line)
    return comps, entry


_BRANCHES = ("branch_computations", "true_computation", "false_computation")


def calls(comps: dict[str, list[str]]) -> dict[str, list[tuple[tuple[str, ...], int, bool]]]:
    """name -> [(called computations, times each runs per call, whether they are one
    conditional's branches: one of them runs)]."""
    out: dict[str, list[tuple[tuple[str, ...], int, bool]]] = collections.defaultdict(list)
    for name, lines in comps.items():
        for line in lines:
            trip = _TRIP.search(line)
            branches: list[str] = []
            for role, targets in _CALLED.findall(line):
                found = re.findall(r"%([^,}\s]+)", targets)
                if role in _BRANCHES:
                    branches += found
                    continue
                factor = int(trip.group(1)) if trip and role in ("body", "condition") else 1
                out[name] += [((t,), factor, False) for t in found]
            if branches:
                out[name].append((tuple(branches), 1, True))
    return out


def multiplicities(comps: dict[str, list[str]], entry: str) -> dict[str, int]:
    """How often each computation runs per execution of the entry computation (every
    branch of a conditional as often as the conditional: an upper bound)."""
    called = calls(comps)
    mult: dict[str, int] = collections.Counter()

    def visit(name: str, m: int) -> None:
        mult[name] += m
        for targets, factor, _ in called.get(name, ()):
            for child in targets:
                visit(child, m * factor)
    visit(entry, 1)
    return mult


_MOVES = {"parameter", "constant", "convert", "bitcast", "copy", "reshape", "transpose", "slice", "tuple",
          "get-tuple-element", "broadcast", "dynamic-slice"}


def _widened(operand: str, defs: dict[str, str], comps: dict[str, list[str]]) -> bool:
    """Whether `operand` is a 16-bit float only widened to float32: a convert of a bf16/f16
    value, a fusion whose result is one (a sum of 16-bit gradients, computed in float32
    and rounded, as the CPU compiler adds bf16), or a fusion of data moves and converts
    through which a bf16/f16 value passes (a 16-bit input, or a float32 rounded to 16 bits
    and widened back). The CPU compiler wraps collectives of 16-bit values so (float
    normalization); an accelerator sends them at 16 bits."""
    rhs = defs.get(operand, "")
    if not rhs.startswith("f32["):
        return False
    fused = re.search(r"calls=%([^,\s]+)", rhs) if " fusion(" in rhs else None
    if fused is None:
        source = re.search(r" convert\(%([^,\s)]+)\)", rhs)
        return source is not None and re.match(r"(bf16|f16)\[", defs.get(source.group(1), "")) is not None
    inner = {m.group(1): m.group(2) for m in map(INSTRUCTION.match, comps.get(fused.group(1), [])) if m}
    root = next((line for line in comps.get(fused.group(1), []) if line.lstrip().startswith("ROOT ")), "")
    m = INSTRUCTION.match(root)
    if m and _widened(m.group(1), inner, {}):  # its result: a 16-bit value widened
        return True
    sixteen = False  # some value on the way is 16-bit: a 16-bit input, or a round trip
    for line in comps.get(fused.group(1), []):
        m = INSTRUCTION.match(line)
        op = re.search(r"(?:^|\s)([a-z][a-z0-9-]*)\(", m.group(2)) if m else None
        if op is None or re.match(r"[su]32\[\]", m.group(2)):  # index arithmetic
            continue
        if op.group(1) not in _MOVES:
            return False
        sixteen |= op.group(1) in ("parameter", "convert") and re.match(r"(bf16|f16)\[", m.group(2)) is not None
    return sixteen


def _merged(instr: str, shape: str, defs: dict[str, str], users: dict[str, list[str]]) -> float:
    """The share of a tuple all-reduce's bytes left once same-shape elements that are only
    added together count once: XLA's GPU pipeline reassociates add(all-reduce(a),
    all-reduce(b)) into all-reduce(add(a, b)) (AllReduceReassociate); the CPU pipeline
    reduces each piece."""
    shapes = SHAPE.findall(shape)
    if len(shapes) < 2:
        return 1.0
    gte = {}
    for user in users.get(instr, []):
        m = re.search(r" get-tuple-element\(.*index=(\d+)", defs[user])
        if m:
            gte[int(m.group(1))] = user
    groups: dict[tuple, list[int]] = collections.defaultdict(list)
    for k, piece in enumerate(shapes):
        consumers = tuple(sorted(users.get(gte.get(k, ""), [])))
        if len(consumers) == 1:
            groups[(piece, consumers)].append(k)
    sizes = [shape_bytes(f"{dt}[{dims}]") for dt, dims in shapes]
    saved = sum(sizes[k] for ks in groups.values() for k in ks[1:])
    return 1.0 - saved / max(sum(sizes), 1)


def _collective_ops(text: str):
    """(kind, executions per step, attributes text, result bytes) of every collective, as
    an accelerator would send it: a float32 op the CPU compiler widened from 16 bits counted
    at 16 bits, and all-reduced pieces that are only added together counted once."""
    comps, entry = computations(text)
    mult = multiplicities(comps, entry)
    for name, lines in comps.items():
        if not mult.get(name):
            continue
        defs, users, found = {}, collections.defaultdict(list), []
        for line in lines:
            m = INSTRUCTION.match(line)
            if not m:
                continue
            defs[m.group(1)] = rhs = re.sub(r"/\*.*?\*/", "", m.group(2))
            op = re.search(r"(?:^|\s)([a-z][a-z0-9-]*)\(", rhs)
            if op is None:
                continue
            for operand in dict.fromkeys(re.findall(r"%([^,\s)]+)", rhs[op.end():rhs.find(")", op.end())])):
                users[operand].append(m.group(1))
            kind = op.group(1).removesuffix("-start")
            if kind in KINDS and not op.group(1).endswith("-done"):
                found.append((m.group(1), kind, op))
        for instr, kind, op in found:
            rhs = defs[instr]
            shape = rhs[:op.start()]
            if op.group(1).endswith("-start"):  # async: (operand, result); count the result
                shape = " ".join(SHAPE.findall(shape)[-1])
                shape = shape.replace(" ", "[", 1) + "]"
            nbytes = shape_bytes(shape)
            operands = re.findall(r"%([^,\s)]+)", rhs[op.end():rhs.index(")", op.end())])
            if "f32[" in shape and (_PROMOTED.search(rhs) or (
                    operands and all(_widened(o, defs, comps) for o in operands))):
                nbytes //= 2
            if kind == "all-reduce":
                nbytes = round(nbytes * _merged(instr, shape, defs, users))
            yield kind, mult[name], rhs, nbytes


def _sent(text: str, devices: int):
    """(kind, executions per step, result bytes, replica groups, ring bytes each device sends
    per execution) of every collective (`_collective_ops`; `wire` in the module docstring)."""
    for kind, times, rhs, nbytes in _collective_ops(text):
        groups = replica_groups(rhs, devices)
        wire = wire_bytes(kind, nbytes, len(groups[0]))
        if kind == "collective-permute":
            wire *= _senders(rhs, devices)
        yield kind, times, nbytes, groups, wire


def collectives(compiled_or_text) -> dict[str, Collective]:
    """Per-step collectives of a compiled program, by kind (see the module docstring)."""
    text = compiled_or_text if isinstance(compiled_or_text, str) else compiled_or_text.as_text()
    partitions = re.search(r"num_partitions=(\d+)", text)
    out = {k: Collective() for k in KINDS}
    for kind, times, nbytes, _, wire in _sent(text, int(partitions.group(1)) if partitions else 1):
        c = out[kind]
        c.count += times
        c.bytes += times * nbytes
        c.wire += times * wire
    return out


def _iota(dims: str, perm: str | None) -> np.ndarray:
    """`[2,4]` with `T(1,0)`: iota over the dims, transposed."""
    shape = [int(d) for d in dims.split(",")]
    ids = np.arange(int(np.prod(shape))).reshape(shape)
    return ids.transpose([int(p) for p in perm.split(",")]) if perm else ids


def replica_groups(attrs: str, devices: int) -> list[list[int]]:
    """The device groups of a collective, as partition ids (positions in the mesh's
    flattened device order): `{{0,4},{1,5}}`, iota `[2,4]<=[4,2]T(1,0)`, or
    `mesh['axis_0'=2,'axis_1'=4], device_ids=... {'axis_1'}`. A collective-permute
    gives its source-target pairs."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(?\[([\d,]+)\](?:<=\[[\d,]+\])?"
                  r"(?:T\(([\d,]+)\))?\)?)?(?: \{('[^}]*)\})?", attrs)
    if m:
        names_sizes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        names, sizes = [n for n, _ in names_sizes], [int(v) for _, v in names_sizes]
        ids = _iota(m.group(2), m.group(3)).reshape(sizes) if m.group(2) else np.arange(int(np.prod(sizes))).reshape(sizes)
        axes = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(4) or "")] or list(range(len(names)))
        rest = [k for k in range(len(names)) if k not in axes]
        grouped = ids.transpose(rest + axes).reshape(-1, int(np.prod([sizes[k] for k in axes])))
        return grouped.tolist()
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
    if m:
        shape = [int(d) for d in m.group(1).split(",")]
        return _iota(m.group(2), m.group(3)).reshape(shape[0], -1).tolist()
    m = re.search(r"replica_groups=\{(\{[\d,{}]*\})\}", attrs)
    if m:
        return [[int(i) for i in g.split(",") if i] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", attrs)
    if m:
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)", m.group(1) + "}")]
    return [list(range(devices))]


def _spans(mesh, node_of=None):
    """-> f(groups) = (mesh axes the groups span, most nodes one group touches)."""
    flat = mesh.devices.flatten()
    node_of = node_of or (lambda d: d.process_index)
    nodes = np.array([node_of(d) for d in flat])
    position = np.stack(np.unravel_index(np.arange(flat.size), mesh.devices.shape), axis=1)

    def spans(groups) -> tuple[tuple[str, ...], int]:
        spanned, most = set(), 1
        for group in groups:
            varies = np.ptp(position[group], axis=0) > 0
            spanned |= {a for a, v in zip(mesh.axis_names, varies) if v}
            most = max(most, len(set(nodes[group].tolist())))
        return tuple(a for a in mesh.axis_names if a in spanned), most
    return spans


def collectives_by_axes(compiled_or_text, mesh, node_of=None) -> dict[tuple[str, ...], dict]:
    """Collectives per step keyed by the mesh axes their groups span, with the most nodes
    one group touches: {("tensor",): {"count": {"all-reduce": 14}, "nodes": 1},
    ("data",): {"count": {"all-reduce": 3}, "nodes": 2}}. An axis is spanned when members
    of one group sit at different positions along it. `node_of(device)` defaults to the
    device's process."""
    out: dict[tuple[str, ...], dict] = {}
    for row in collective_table(compiled_or_text, mesh, node_of):
        entry = out.setdefault(row["mesh_axes"], {"count": collections.Counter(), "nodes": 1})
        entry["count"][row["kind"]] += row["count"]
        entry["nodes"] = max(entry["nodes"], row["nodes"])
    return out


def collective_table(compiled_or_text, mesh, node_of=None) -> list[dict]:
    """Collectives per step by (kind, mesh axes spanned, whether a group crosses nodes):
    [{kind, mesh_axes, count, bytes, result_bytes, nodes}], `bytes` being the ring-algorithm
    bytes each device sends per step (see `wire` above) and `result_bytes` the ops' result
    sizes, both summed over executions (loop trip counts included); `nodes`: the most
    nodes one group touches (a row's ops all stay in a node, or all cross: an axis whose
    groups are cut in a node's and across nodes, as a hierarchical reduction does, gives
    two rows)."""
    text = compiled_or_text if isinstance(compiled_or_text, str) else compiled_or_text.as_text()
    spans = _spans(mesh, node_of)
    rows: dict[tuple[str, tuple[str, ...], bool], dict] = {}
    for kind, times, nbytes, groups, wire in _sent(text, mesh.devices.size):
        axes, most = spans(groups)
        row = rows.setdefault((kind, axes, most > 1), {"kind": kind, "mesh_axes": axes, "count": 0, "bytes": 0.0,
                                                       "result_bytes": 0, "nodes": 1})
        row["count"] += times
        row["bytes"] += times * wire
        row["result_bytes"] += times * nbytes
        row["nodes"] = max(row["nodes"], most)
    return sorted(rows.values(), key=lambda r: (r["mesh_axes"], KINDS.index(r["kind"]), r["nodes"]))


def with_compiled(f: dict, rows: list[dict], kinds) -> dict:
    """A formula's dict `f` ("mesh_axes", "bytes") with the compiled step's collectives of
    `kinds` over exactly its mesh axes (`rows`: collective_table): "compiled_bytes",
    "compiled_count" and "ratio" (compiled / formula; None without formula bytes)."""
    mine = [r for r in rows if r["kind"] in kinds and list(r["mesh_axes"]) == list(f["mesh_axes"])]
    f["compiled_bytes"] = sum(r["bytes"] for r in mine)
    f["compiled_count"] = sum(r["count"] for r in mine)
    f["ratio"] = f["compiled_bytes"] / f["bytes"] if f["bytes"] else None
    return f
