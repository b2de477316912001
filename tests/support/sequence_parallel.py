"""Megatron sequence parallelism (Korthikanti et al. 2022, arXiv 2205.05198) read off a
compiled step: what one layer sends over `tensor`, forward and backward.

Tensor parallelism (Megatron, arXiv 1909.08053) all-reduces the layer's [b, T, D] output
twice forward (after attention's and the MLP's row-parallel matmul) and twice backward
(the input gradients of the column-parallel matmuls). Sequence parallelism keeps the
residual stream split by position over `tensor` between those matmuls (`length:tensor`
last in the *_sp presets), so each all-reduce becomes a reduce-scatter (into the split
stream) and an all-gather (out of it, before the next column-parallel matmul) of the
same [b, T, D]: on a ring 2(t-1)/t x S = (t-1)/t x S + (t-1)/t x S, the same bytes.

    ops = layer_collectives(compiled, mesh, layers, stream_bytes)
    ops[("forward", "reduce-scatter")]  # LayerOps(count, bytes, wire) per layer, over tensor
    megatron(stream_bytes, t, sp=True)  # the same table by the formula

The CPU compiler does not form reduce-scatters: it all-reduces and lets each consumer
slice its 1/t piece (fused into the consumer, where an accelerator's ReduceScatterCreator
pass makes one reduce-scatter). An all-reduce whose every use takes only a 1/t slice
(a `dynamic-slice`, alone or as the only use of the value inside a fusion) is counted
as the reduce-scatter it is on an accelerator. A layer's op is one inside a loop that
runs `layers` times; backward is what JAX names `transpose(...)` in the op's metadata.
Only ops whose (per tuple element) result is one [b, T, D] stream count as the stream's
("activation"); the rest (weights XLA chose to gather, norm-weight gradients) are listed
under "other" so nothing is hidden.
"""

from __future__ import annotations

import collections
import dataclasses
import re

import numpy as np

from meshtrain.planner import hlo

PASSES = ("forward", "backward")
_SLICE = re.compile(r"\sdynamic-slice\(%([^,\s)]+)")


@dataclasses.dataclass
class LayerOps:
    count: float = 0.0  # executions per layer
    bytes: float = 0.0  # result bytes per layer (a reduce-scatter: its input, the whole [b, T, D])
    wire: float = 0.0   # bytes each device sends per layer (ring algorithms)


def megatron(stream_bytes: float, t: int, sp: bool) -> dict[tuple[str, str], LayerOps]:
    """One layer's tensor collectives by the formula, for one [b, T, D] stream of
    `stream_bytes` (whole, before any split): TP 2 all-reduces each way; SP 2
    reduce-scatters + 2 all-gathers each way (the backward's gathers are the transposes
    of the forward's reduce-scatters; a backward that does not keep the forward's gathered
    norm output gathers it again, 2 more, which `layer_collectives` reports as found)."""
    share = (t - 1) / t
    out = {}
    for p in PASSES:
        if sp:
            out[(p, "reduce-scatter")] = LayerOps(2, 2 * stream_bytes, 2 * share * stream_bytes)
            out[(p, "all-gather")] = LayerOps(2, 2 * stream_bytes, 2 * share * stream_bytes)
        else:
            out[(p, "all-reduce")] = LayerOps(2, 2 * stream_bytes, 2 * 2 * share * stream_bytes)
    return out


def layer_collectives(compiled_or_text, mesh, layers: int, stream_bytes: int,
                      axis: str = "tensor") -> dict[tuple[str, str], LayerOps]:
    """{(pass, kind): LayerOps} of the [b, T, D] collectives over `axis` alone that one
    layer runs, and {(pass, "other " + kind): ...} of its other collectives over `axis`
    (module docstring). `stream_bytes`: one [b, T, D] on a device before any split, in
    the dtype the ops carry (the CPU compile's: float32)."""
    text = compiled_or_text if isinstance(compiled_or_text, str) else compiled_or_text.as_text()
    comps, entry = hlo.computations(text)
    mult = hlo.multiplicities(comps, entry)
    position = np.stack(np.unravel_index(np.arange(mesh.devices.size), mesh.devices.shape), axis=1)
    names = list(mesh.axis_names)
    out: dict[tuple[str, str], LayerOps] = collections.defaultdict(LayerOps)
    for name, lines in comps.items():
        if mult.get(name) != layers:
            continue
        defs, users = _uses(lines)
        for instr, rhs in defs.items():
            op = re.search(r"(?:^|\s)([a-z][a-z0-9-]*)\(", rhs)
            if op is None or op.group(1).endswith("-done"):
                continue
            kind = op.group(1).removesuffix("-start")
            if kind not in hlo.KINDS:
                continue
            groups = hlo.replica_groups(rhs, mesh.devices.size)
            varies = np.ptp(position[groups[0]], axis=0) > 0
            if [a for a, v in zip(names, varies) if v] != [axis]:
                continue
            n = len(groups[0])
            meta = re.search(r'op_name="([^"]*)"', rhs)
            p = "backward" if meta and "transpose(" in meta.group(1) else "forward"
            shapes = hlo.SHAPE.findall(rhs[:op.start()])
            if op.group(1).endswith("-start"):  # async (operand, result): the result
                shapes = shapes[-1:]
            for k, (dtype, dims) in enumerate(shapes):
                nbytes = hlo.shape_bytes(f"{dtype}[{dims}]")
                real = kind
                if kind == "all-reduce":
                    value = _element(instr, k, len(shapes), defs, users)
                    if value is not None and _sliced(value, nbytes, n, defs, users, comps):
                        real = "reduce-scatter"
                wire = hlo.wire_bytes(real, nbytes // n if real == "reduce-scatter" else nbytes, n)
                key = (p, real if nbytes == stream_bytes else "other " + real)
                o = out[key]
                o.count, o.bytes, o.wire = o.count + 1, o.bytes + nbytes, o.wire + wire
    return dict(out)


def _uses(lines: list[str]) -> tuple[dict[str, str], dict[str, list[str]]]:
    """(instruction -> its right-hand side, value -> the instructions that read it)."""
    defs, users = {}, collections.defaultdict(list)
    for line in lines:
        m = hlo.INSTRUCTION.match(line)
        if not m:
            continue
        defs[m.group(1)] = rhs = re.sub(r"/\*.*?\*/", "", m.group(2))
        op = re.search(r"(?:^|\s)([a-z][a-z0-9-]*)\(", rhs)
        if op:
            close = rhs.find(")", op.end())
            for operand in dict.fromkeys(re.findall(r"%([^,\s)]+)", rhs[op.end():close])):
                users[operand].append(m.group(1))
    return defs, users


def _element(instr: str, k: int, n_elements: int, defs, users) -> str | None:
    """The value holding element k of an all-reduce's result: the op itself, or the
    get-tuple-element of index k of a tuple all-reduce."""
    if n_elements == 1:
        return instr
    for user in users.get(instr, []):
        if re.search(rf" get-tuple-element\(.*index={k}\b", defs[user]):
            return user
    return None


def _sliced(value: str, nbytes: int, n: int, defs, users, comps) -> bool:
    """Whether every use of `value` (nbytes) takes a 1/n slice of it: a dynamic-slice of
    nbytes/n, or a fusion inside which the value's parameter feeds only such slices."""
    readers = users.get(value, [])
    if not readers:
        return False
    for reader in readers:
        rhs = defs[reader]
        if _SLICE.search(" " + rhs):
            if hlo.shape_bytes(rhs.split(" ")[0]) * n != nbytes:
                return False
            continue
        called = re.search(r" fusion\((.*?)\), kind=.*calls=%([^,\s]+)", rhs)
        if called is None:
            return False
        operands = re.findall(r"%([^,\s)]+)", called.group(1))
        inner_defs, inner_users = _uses(comps.get(called.group(2), []))
        for index in (i for i, o in enumerate(operands) if o == value):
            param = next((d for d, r in inner_defs.items() if re.search(rf" parameter\({index}\)", r)), None)
            inner = inner_users.get(param, []) if param else []
            if not inner or not all(_SLICE.search(" " + inner_defs[u]) and
                                    hlo.shape_bytes(inner_defs[u].split(" ")[0]) * n == nbytes for u in inner):
                return False
    return True
