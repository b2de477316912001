"""Matmul and conv FLOPs of a compiled program, per device per step: each computation's
own dots and convolutions, weighted by how often it runs (the loops' trip counts around
it, as planner/hlo.py weighs collectives), a `conditional`'s costliest branch once per
execution.

    dot_flops(exp.compile())     # matmul and conv FLOPs per step per device
    conditionals(exp.compile())  # each `conditional`'s branches' matmul FLOPs
"""

from __future__ import annotations

import re

import numpy as np

from meshtrain.planner import hlo


def _dims(shape: str) -> list[int]:
    m = hlo.SHAPE.search(shape)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def _own_dot_flops(lines: list[str], batched: bool) -> float:
    """Matmul and conv FLOPs of one computation's own instructions, once (`dot_flops`)."""
    shapes, total = {}, 0.0
    for line in lines:
        m = hlo.INSTRUCTION.match(line)
        if not m:
            continue
        shapes[m.group(1)] = m.group(2).split(" ")[0]
        op = re.search(r"\sdot\(%([^,\s)]+)", m.group(2))
        if batched and not (op and re.search(r"lhs_batch_dims=\{\d", line)):
            continue
        if op:
            lhs = _dims(shapes.get(op.group(1), ""))
            contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", line)
            k = int(np.prod([lhs[int(i)] for i in contracting.group(1).split(",") if i])) if contracting else 1
            total += 2.0 * np.prod(_dims(m.group(2))) * k
            continue
        conv = re.search(r"\sconvolution\(%[^,\s)]+, %([^,\s)]+)\)", m.group(2))
        labels = re.search(r"dim_labels=[^_]+_([^-]+)->", line)
        if conv and labels and "o" in labels.group(1):
            rhs = _dims(shapes.get(conv.group(1), ""))
            if rhs:
                per_output = np.prod(rhs) / rhs[labels.group(1).index("o")]
                # A strided conv's input gradient dilates dy with zeros (lhs_dilate): the
                # window meets a real value once in prod(dilation) places, as a
                # transposed conv on an accelerator computes it.
                dilate = re.search(r"lhs_dilate=([\dx]+)", line)
                per_output /= np.prod([int(d) for d in dilate.group(1).split("x")]) if dilate else 1
                total += 2.0 * np.prod(_dims(m.group(2))) * per_output
    return total


def _flops_of(text: str, batched: bool):
    """-> (computations, entry, cost(name): FLOPs of one run of a computation and all it
    calls, a conditional's costliest branch counted once)."""
    comps, entry = hlo.computations(text)
    calls = hlo.calls(comps)
    own = {name: _own_dot_flops(lines, batched) for name, lines in comps.items()}
    memo: dict[str, float] = {}

    def cost(name: str) -> float:
        if name not in memo:
            total = own.get(name, 0.0)
            for targets, factor, branches in calls.get(name, ()):
                each = [cost(t) for t in targets]
                total += factor * (max(each) if branches else sum(each))
            memo[name] = total
        return memo[name]
    return comps, entry, cost


def dot_flops(compiled_or_text, batched: bool = False) -> float:
    """Matmul FLOPs one device runs per step: 2 x |result| x |contracted dims| per `dot`,
    and 2 x |result| x |kernel| / its output features per `convolution` (each output sums
    the kernel's window x input features; zero padding counted, the zeros a strided conv's
    input gradient dilates dy with not),
    weighted by loop trip counts, a conditional's costliest branch once per execution.
    Unlike cost_analysis, it ignores element-wise work (whose count moves with XLA's
    fusion choices) and counts every loop iteration. `batched`: only dots with batch
    dimensions (in a transformer, attention's scores and values: the projections have
    none; XLA drops the ops' source names from some bf16 dots, so this is the test)."""
    text = compiled_or_text if isinstance(compiled_or_text, str) else compiled_or_text.as_text()
    _, entry, cost = _flops_of(text, batched)
    return cost(entry)


def conditionals(compiled_or_text, batched: bool = False) -> list[dict]:
    """Every `conditional` of the program: [{"name", "executions" per step (the loops
    around it; nested in a branch: as if its branch always ran), "branch_flops": [matmul
    FLOPs of one run of each branch, `batched` as dot_flops]}]."""
    text = compiled_or_text if isinstance(compiled_or_text, str) else compiled_or_text.as_text()
    comps, entry, cost = _flops_of(text, batched)
    mult = hlo.multiplicities(comps, entry)
    calls = hlo.calls(comps)
    out = []
    for name, lines in comps.items():
        if not mult.get(name):
            continue
        groups = iter(targets for targets, _, branches in calls.get(name, ()) if branches)
        for line in lines:
            m = hlo.INSTRUCTION.match(line)
            if m and " conditional(" in m.group(2):
                out.append({"name": m.group(1), "executions": mult[name],
                            "branch_flops": [cost(t) for t in next(groups)]})
    return out
