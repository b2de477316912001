"""What the layout linter (planner/lint.py) reports, and the arithmetic its checks share.

    Finding(code, severity, what, cost, fix)     # str(f): "what. Cost: cost. Fix: fix"
    fix_overrides(fix) -> [(key, value)]         # the leading --config.key=value tokens
"""

from __future__ import annotations

import dataclasses
import math
import shlex

from meshtrain import mesh as mesh_lib
from meshtrain.parallel.layouts.rules import TARGETS, Layout, format_rules, mesh_axes_of
from meshtrain.planner.split_cost import group_size, split_over


@dataclasses.dataclass(frozen=True)
class Finding:
    code: str      # stable id, e.g. "replicated-param"
    severity: str  # "error" (the run cannot work / fails validation) or "warning"
    what: str      # what is wrong, with the numbers
    cost: str      # what it costs: bytes per device, share of the step idle, bandwidth ratio
    fix: str       # --config.key=value overrides that fix it, then prose; or prose alone

    def __str__(self) -> str:
        return f"{self.what.rstrip('.')}. Cost: {self.cost.rstrip('.')}. Fix: {self.fix}"


def fix_overrides(fix: str) -> list[tuple[str, str]]:
    """The leading `--config.key=value` tokens of a fix, as (key, value) pairs (unquoted)."""
    lexer = shlex.shlex(fix, posix=True)
    lexer.whitespace_split = True
    out = []
    while True:
        try:
            token = lexer.get_token()
        except ValueError:  # an unmatched quote in the prose
            return out
        key, sep, value = (token or "").partition("=")
        if not (key.startswith("--config.") and sep):
            return out
        out.append((key.removeprefix("--config."), value))


@dataclasses.dataclass(frozen=True)
class Run:
    """One config under lint: the numbers every check reads."""
    cfg: object
    layout: Layout
    shape: dict
    dcn: dict | None
    dims: dict
    model: object
    hw: object  # planner/hardware.Hardware: the links the costs quote


def override(key: str, value) -> str:
    return f"--config.{key}={shlex.quote(str(value))}"


def mesh_text(shape) -> str:
    text = mesh_lib.format_factors(shape)
    return mesh_lib.format_shape(shape) if text == "1" else text


def axes_text(shape, axes) -> str:
    return " x ".join(f"{a}={shape[a]}" for a in axes)


def named_axes(layout: Layout) -> set[str]:
    """The mesh axes some rule of the layout maps a logical name to, in any table."""
    return {a for t in TARGETS for _, axes in layout.rules(t) for a in axes}


def surplus_to_data(run: Run, axis: str, over, count: int, key: str) -> str:
    """The fix for model.`key`=count split over the mesh axes `over` and not dividing: `axis`
    (one of `over`) cut to its largest divisor d that makes the split divide count, the surplus
    moved to data; where no d does (or `axis` is not in `over`), what to do, in words."""
    size, n = run.shape[axis], group_size(run.shape, over)
    d = max((d for d in range(1, size + 1) if size % d == 0 and count % (n // size * d) == 0),
            default=None) if axis in over else None
    if d is None:
        return f"make {'+'.join(over)} multiply to a divisor of model.{key}={count}"
    fix = override("mesh.shape", mesh_text({**run.shape, axis: d, "data": run.shape["data"] * size // d}))
    if run.dcn and d % run.dcn[axis]:
        fix += f" (and give mesh.dcn {'an' if axis[0] in 'aeiou' else 'a'} {axis} factor dividing {d})"
    return fix


def axes_of(layout: Layout, names, target: str) -> tuple[str, ...]:
    return tuple(a for e in layout.spec(names, target) for a in mesh_axes_of(e))


def batch_multiple(run: Run, m: int) -> int:
    """What train.batch_size must be a multiple of with m pipeline microbatches (check_batch)."""
    return batch_quantum(run.cfg.train.grad_accum_steps, run.layout, run.shape, m)


def batch_quantum(k: int, layout: Layout, shape, m: int) -> int:
    """The smallest batch k accumulation steps and m pipeline microbatches (0: none) divide
    under `layout` on mesh `shape` (experiment.check_batch's arithmetic)."""
    q = k * split_over(layout, shape, "batch")[0]
    return math.lcm(q, k * m * split_over(layout.without("stage"), shape, "batch")[0]) if m > 0 else q


def layout_text(params, opt_state, activations, grads=None) -> str:
    """The rule tables in the grammar, shortest form (opt_state and grads follow params
    follows the unlabelled section; grads None: follows params)."""
    parts = [format_rules(activations)]
    if params != activations:
        parts.append(f"params={format_rules(params)}")
    if opt_state != params:
        parts.append(f"opt_state={format_rules(opt_state)}")
    if grads is not None and grads != params:
        parts.append(f"grads={format_rules(grads)}")
    return " | ".join(p for p in parts if p)


def leaves_of(model):
    """[(path, shape, itemsize, logical axes)] of the parameters."""
    from meshtrain import tree_paths
    axes = tree_paths.flat(model.axes, is_leaf=lambda x: isinstance(x, tuple))
    return [(p, tuple(s.shape), s.dtype.itemsize, axes[p]) for p, s in tree_paths.flat(model.shapes).items()]
