"""Layout linter: what a config's layout costs on its mesh, found before anything compiles.

    findings = lint(cfg, mesh_shape, dcn, model)     # [Finding(code, severity, what, cost, fix)]

Each finding says what is wrong with the numbers, what it costs, and a fix: zero or more
`--config.key=value` overrides (shell-quoted), possibly followed by prose in parentheses,
or prose alone when no override fixes it cleanly. `fix_overrides(fix)` reads the overrides
back. The checks, by code:

  replicated-param    (warning, needs `model`) a parameter of at least max(1 MiB, 1% of all
                      parameter bytes) left whole over a mesh axis (size > 1) on which the layout
                      splits other weights; cost in bytes per device (param + 2 Adam moments)
  tensor-on-dcn       (warning) mesh.dcn puts the tensor axis across nodes; cost in bytes per
                      step and the NVLink / InfiniBand bandwidth ratio
  batch-indivisible   (error) train.batch_size does not split evenly (experiment.check_batch)
  tensor-over-heads   (error) the attention heads do not split evenly over the tensor axis
  pipeline-bubble     (warning) the pipeline bubble (S-1)/(r*M+S-1) is over 25% of the step
  zero-saves-nothing  (warning) the layout shards weights, gradients or moments over data/fsdp, all of size 1
  unused-axis         (warning) a mesh axis of size > 1 that no rule of the layout names: every
                      device along it repeats the same work; the fix is the preset that uses
                      every axis (layouts.presets.PRESET_AXES)

`stage` on DCN is not flagged: a pipeline sends one microbatch slot between neighbouring
stages per tick, the lightest traffic of any axis (docs/multihost.md).
Bytes are bytes, MiB are 2**20 bytes; bandwidths are GB/s = 1e9 bytes/s per direction.
"""

from __future__ import annotations

import dataclasses
import math
import shlex

from meshtrain import layouts, mesh as mesh_lib, models
from meshtrain.errors import UserError
from meshtrain.layouts.rules import TARGETS, Layout, format_rules, mesh_axes_of
from meshtrain.mesh import AXES
from meshtrain.planner import hardware

MiB = 2**20
BUBBLE_LIMIT = 0.25                      # the largest idle share of a pipelined step not flagged
# The bandwidths the costs quote: the planner's H100 (NVLink 4 one way, one ConnectX-7 NDR
# NIC per GPU), in GB/s.
NVLINK_GBPS = round(hardware.TABLE["h100"].link_bandwidth / 1e9)
IB_GBPS = round(hardware.TABLE["h100"].network_bandwidth / 1e9)
# The layout that does the same as a sharded preset when its sharding axes have size 1.
PLAIN = {"fsdp": "dp", "zero1": "dp", "zero2": "dp", "fsdp_tp": "dp_tp", "fsdp_pp": "dp_pp", "zero1_pp": "dp_pp",
         "zero2_pp": "dp_pp", "fsdp_pp_tp": "dp_pp_tp"}
_STACKED = ("layers", "stage")


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
class _Run:
    cfg: object
    layout: Layout
    shape: dict
    dcn: dict | None
    dims: dict
    model: object


def lint(cfg, mesh_shape: dict[str, int] | None = None, dcn: dict[str, int] | None = None,
         model=None) -> list[Finding]:
    """Findings for `cfg` (a locked config), errors first.

    mesh_shape: the resolved {data, stage, fsdp, tensor} sizes (default: cfg.mesh.shape, with no
    -1); dcn: the inter-node factor of each axis (default: mesh.parse_dcn(cfg.mesh.dcn, shape));
    model: a state.ModelDef (Experiment.model, or validate(...).model) for the checks that need
    parameter shapes; without it the model's dims come from model.size and model.* overrides.
    Raises UserError only for a config it cannot read (unknown layout, bad mesh or model size).
    """
    shape = mesh_lib.parse_shape(mesh_shape if mesh_shape is not None else cfg.mesh.shape)
    if -1 in shape.values():
        raise UserError(f"lint needs every mesh axis sized, but mesh.shape={cfg.mesh.shape!r} has a -1; "
                        f"pass the resolved shape (mesh.resolve_shape with the device count).")
    if dcn is None:
        dcn = mesh_lib.parse_dcn(cfg.mesh.dcn, shape)
    dims = dataclasses.asdict(model.cfg) if model is not None else models.size_dims(cfg.model)
    run = _Run(cfg, layouts.get(cfg.layout), shape, dcn, dims, model)
    found = [*_batch(run), *_heads(run), *_unused(run), *_replicated(run), *_tensor_on_dcn(run), *_bubble(run),
             *_zero(run)]
    return sorted(found, key=lambda f: f.severity != "error")


# ---------------------------------------------------------------------------------- helpers

def _n(shape, axes) -> int:
    return math.prod(shape[a] for a in axes)


def _mib(b: float) -> str:
    return f"{b / MiB:,.1f} MiB"


def _override(key: str, value) -> str:
    return f"--config.{key}={shlex.quote(str(value))}"


def _mesh_text(shape) -> str:
    text = mesh_lib.format_factors(shape)
    return mesh_lib.format_shape(shape) if text == "1" else text


def _named_axes(layout: Layout) -> set[str]:
    """The mesh axes some rule of the layout maps a logical name to, in any table."""
    return {a for t in TARGETS for _, axes in layout.rules(t) for a in axes}


def _axes_of(layout: Layout, names, target: str) -> tuple[str, ...]:
    return tuple(a for e in layout.spec(names, target) for a in mesh_axes_of(e))


def _batch_shards(layout: Layout, shape) -> int:
    return layout.shards("batch", shape)[0]


def _batch_multiple(run: _Run, m: int) -> int:
    """What train.batch_size must be a multiple of with m pipeline microbatches (check_batch)."""
    k = run.cfg.train.microbatches
    q = k * _batch_shards(run.layout, run.shape)
    return math.lcm(q, k * m * _batch_shards(run.layout.without("stage"), run.shape)) if m > 0 else q


def _layout_text(params, opt_state, activations, grads=None) -> str:
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


def _leaves(model):
    """[(path, shape, itemsize, logical axes)] of the parameters."""
    from meshtrain import tree_paths
    axes = tree_paths.flat(model.axes, is_leaf=lambda x: isinstance(x, tuple))
    return [(p, tuple(s.shape), s.dtype.itemsize, axes[p]) for p, s in tree_paths.flat(model.shapes).items()]


def _divides(shape, names, spec, mesh_shape) -> bool:
    return all(size % _n(mesh_shape, mesh_axes_of(e)) == 0
               for size, name, e in zip(shape, names, tuple(spec) + (None,) * len(shape)) if name != "batch")


# ----------------------------------------------------------------------------------- checks

def _batch(run: _Run) -> list[Finding]:
    t, m = run.cfg.train, max(run.cfg.pipeline.microbatches, 0)
    if t.microbatches < 1:
        return []  # validation refuses it, with its own message
    q, b = _batch_multiple(run, m), t.batch_size
    if b >= 1 and b % q == 0:
        return []
    lo, hi = b // q * q, max(-(-b // q), 1) * q
    new = hi if lo < 1 or hi - b <= b - lo else lo
    k, outer = t.microbatches, _batch_shards(run.layout, run.shape)
    why = f"train.microbatches x batch shards = {k} x {outer}"
    if m > 0:
        inner = _batch_shards(run.layout.without("stage"), run.shape)
        why = (f"lcm({why}, train.microbatches x pipeline.microbatches x batch shards in a stage = "
               f"{k} x {m} x {inner})")
    return [Finding("batch-indivisible", "error",
                    f"train.batch_size={b} is not a multiple of {q} = {why} under layout {run.layout.name!r} "
                    f"on mesh {_mesh_text(run.shape)}",
                    "the run cannot start: validation refuses a batch that does not split evenly",
                    _override("train.batch_size", new))]


def _heads(run: _Run) -> list[Finding]:
    h = run.dims.get("num_heads")
    over = sorted({a for t in TARGETS for a in _axes_of(run.layout, ("heads",), t)}, key=AXES.index)
    n, t = _n(run.shape, over), run.shape["tensor"]
    if not h or "tensor" not in over or h % n == 0:
        return []
    other = n // t
    d = max((d for d in range(1, t + 1) if t % d == 0 and h % (other * d) == 0), default=None)
    if d is None:
        fix = f"make {'+'.join(over)} multiply to a divisor of model.num_heads={h}"
    else:
        new = {**run.shape, "tensor": d, "data": run.shape["data"] * t // d}
        fix = _override("mesh.shape", _mesh_text(new))
        if run.dcn and d % run.dcn["tensor"]:
            fix += f" (and give mesh.dcn a tensor factor dividing {d})"
    more = f"{n} ranks for {h} heads" if n > h else f"{h} is not divisible by {n}"
    return [Finding("tensor-over-heads", "error",
                    f"layout {run.layout.name!r} splits the model.num_heads={h} attention heads over "
                    f"{' x '.join(f'{a}={run.shape[a]}' for a in over)}: {more}",
                    "the run cannot start: validation refuses heads that do not split evenly "
                    "(every rank needs whole heads)", fix)]


def _replicated(run: _Run) -> list[Finding]:
    if run.model is None:
        return []
    leaves, shape, lay = _leaves(run.model), run.shape, run.layout
    total = sum(math.prod(s) * i for _, s, i, _ in leaves)
    used = {a for *_, axes in leaves for a in _axes_of(lay, axes, "params")}
    used = [a for a in AXES if a in used and a != "stage" and shape[a] > 1]
    limit = max(MiB, total / 100)
    groups: dict = {}
    for leaf in leaves:
        path, s, item, axes = leaf
        missing = tuple(a for a in used if a not in _axes_of(lay, axes, "params"))
        if missing and math.prod(s) * item >= limit:
            groups.setdefault((missing, _replication_fix(run, leaf, missing, leaves)), []).append(leaf)
    found = []
    for (missing, fix), group in groups.items():
        n, extra = _n(shape, missing), 0.0
        for _, s, item, axes in group:
            for target, copies in (("params", 1), ("opt_state", 2)):
                have = _axes_of(lay, axes, target)
                left = [a for a in missing if a not in have]
                extra += copies * math.prod(s) * item / _n(shape, have) * (1 - 1 / _n(shape, left))
        _, s0, i0, a0 = group[0]
        each = math.prod(s0) * i0 / _n(shape, _axes_of(lay, a0, "params"))
        simple = len(group) == 1 and lay.spec(a0, "params") == lay.spec(a0, "opt_state")
        names = " and ".join(f"{p} {list(s)} ({_mib(math.prod(s) * i)})" for p, s, i, _ in group)
        each_at = "each at least" if len(group) > 1 else "at least"
        kv = " (kv_heads is kept unsplit on purpose, docs/layouts.md 'Grouped-query attention')" \
            if all("kv_heads" in a for *_, a in group) else ""
        over = " x ".join(f"{a}={shape[a]}" for a in missing)
        found.append(Finding(
            "replicated-param", "warning",
            f"{'Parameters' if len(group) > 1 else 'Parameter'} {names}, {each_at} max(1 MiB, 1% of the "
            f"{_mib(total)} of parameters), {'are' if len(group) > 1 else 'is'} whole over {over}, on which "
            f"layout {lay.name!r} splits other weights{kv}",
            f"{_mib(extra)} more per device for the parameter{'s' if len(group) > 1 else ''} and "
            f"{'their' if len(group) > 1 else 'its'} 2 Adam moments than split {n} ways"
            + (f" ({_mib(each)} per device x (1 - 1/{n}) x 3)" if simple else ""), fix))
    return found


def _replication_fix(run: _Run, leaf, missing, leaves) -> str:
    """A layout with one more rule that splits `leaf` over `missing`, checked to parse and to
    divide every parameter (and activation, for kv_heads); else what to do, in words."""
    _, s, _, axes = leaf
    n, lay, plus = _n(run.shape, missing), run.layout, "+".join(missing)
    free = [a for a, e in zip(axes, lay.spec(axes, "params")) if a is not None and e is None]
    if "kv_heads" in axes:
        k = s[axes.index("kv_heads")]
        if k % n:
            return (f"none in the layout: model.num_kv_heads={k} is not divisible by {plus}={n}, so the kv "
                    f"heads cannot split; accept the cost, or use a {plus} size that divides {k}")
        free, targets = ["kv_heads"], TARGETS
    else:
        targets = ("params", "opt_state", "grads")
    for name in dict.fromkeys(a for a in free if a not in _STACKED):
        if any(size % n for size, a in zip(s, axes) if a == name):
            continue
        tables = {t: lay.rules(t) + ((name, missing),) if t in targets else lay.rules(t) for t in TARGETS}
        text = _layout_text(tables["params"], tables["opt_state"], tables["activations"], tables["grads"])
        new = layouts.get(text)
        if any(new.rules(t) != tables[t] for t in TARGETS) or set(missing) - set(_axes_of(new, axes, "params")):
            continue
        arrays = [(sh, a, t) for _, sh, _, a in leaves for t in ("params", "opt_state")]
        if "activations" in targets:
            arrays += [(sh, a, "activations") for _, sh, a in run.model.family.activations(run.model.cfg, 1)]
        if all(_divides(sh, a, new.spec(a, t), run.shape) for sh, a, t in arrays):
            return _override("layout", text)
    return (f"no single rule splits it evenly: none of its unsplit dims ({', '.join(free) or 'none'}) is "
            f"divisible by {plus}={n}; accept the cost, or add a rule for it by hand (docs/layouts.md)")


def _tensor_on_dcn(run: _Run) -> list[Finding]:
    dcn, shape = run.dcn, run.shape
    if not dcn or dcn["tensor"] <= 1 or "tensor" not in _named_axes(run.layout):
        return []
    import jax.numpy as jnp
    f, t, d = dcn["tensor"], shape["tensor"], run.dims
    ratio = (f"~{IB_GBPS} GB/s (InfiniBand NDR) instead of ~{NVLINK_GBPS} GB/s (NVLink 4): "
             f"{NVLINK_GBPS / IB_GBPS:.0f}x slower")
    cost = f"the tensor all-reduces go at {ratio} (H100 SXM and ConnectX-7 vendor data sheets)"
    if all(isinstance(d.get(k), int) for k in ("num_layers", "seq_len", "embed_dim")):
        rows = run.cfg.train.batch_size / _batch_shards(run.layout.without("stage"), shape)
        dtype = run.model.cfg.dtype if run.model is not None else run.cfg.model.dtype
        wire = (4 * d["num_layers"] / shape["stage"] * 2 * (t - 1) / t * rows * d["seq_len"]
                * d["embed_dim"] * jnp.dtype(dtype).itemsize)
        cost = (f"about {_mib(wire)} per device per step of tensor all-reduces (4 per layer of [rows, "
                f"seq_len, embed] in {dtype}, 2(t-1)/t on the wire) go at {ratio}, at least "
                f"{wire / IB_GBPS / 1e6:,.1f} ms instead of {wire / NVLINK_GBPS / 1e6:,.1f} ms per step "
                f"(H100 SXM and ConnectX-7 vendor data sheets)")
    for to in ("data", "fsdp"):
        if shape[to] % (dcn[to] * f) == 0:
            fix = _override("mesh.dcn", mesh_lib.format_factors({**dcn, to: dcn[to] * f, "tensor": 1}))
            break
    else:
        fix = (f"neither data={shape['data']} nor fsdp={shape['fsdp']} can take the {f} nodes: change "
               f"mesh.shape so data is a multiple of {dcn['data'] * f}, then put the nodes on data in mesh.dcn")
    return [Finding("tensor-on-dcn", "warning",
                    f"mesh.dcn={mesh_lib.format_factors(dcn)} puts the tensor axis (tensor={t}) across {f} "
                    f"nodes: tensor parallelism all-reduces activations in every layer, forward and "
                    f"backward, and should stay inside a node", cost, fix)]


def _bubble(run: _Run) -> list[Finding]:
    p, s = run.cfg.pipeline, run.shape["stage"]
    m, r = p.microbatches, (p.repeats if p.schedule == "circular" else 1)
    if s <= 1 or m <= 0 or r < 1 or 4 * (s - 1) <= r * m + s - 1:
        return []
    bubble = (s - 1) / (r * m + s - 1)
    step = s if r > 1 else 1
    need = -(-3 * (s - 1) // r)  # the smallest M with r*M >= 3(S-1), i.e. bubble <= 25%
    low = -(-need // step) * step
    b, k = run.cfg.train.batch_size, run.cfg.train.microbatches
    top = b // max(k * _batch_shards(run.layout.without("stage"), run.shape), 1)
    fits = [x for x in range(low, top + 1, step) if b % _batch_multiple(run, x) == 0]
    new = fits[0] if fits else low
    fix = _override("pipeline.microbatches", new)
    grow = ""
    if not fits:
        q = _batch_multiple(run, new)
        fix += " " + _override("train.batch_size", -(-b // q) * q)
        grow = f"; the batch must grow to {-(-b // q) * q} for {new} microbatches to divide it"
    after = (s - 1) / (r * new + s - 1)
    sign = "<" if m < s else "with"
    return [Finding("pipeline-bubble", "warning",
                    f"pipeline.microbatches={m} {sign} stage={s}: the bubble (S-1)/(r*M+S-1) = {s - 1}/"
                    f"{r * m + s - 1} = {bubble:.1%} of the pipelined work is idle, over {BUBBLE_LIMIT:.0%}",
                    f"{bubble:.1%} of each pipelined step idle; with M={new} it is {s - 1}/{r * new + s - 1} = "
                    f"{after:.1%}{grow}", fix)]


def _zero(run: _Run) -> list[Finding]:
    lay, shape = run.layout, run.shape
    zero = [a for a in AXES if a in ("data", "fsdp") and any(
        a in axes for t in ("params", "opt_state", "grads") for name, axes in lay.rules(t) if name != "batch")]
    if not zero or any(shape[a] > 1 for a in zero):
        return []
    def strip(rules):
        kept = ((n, tuple(a for a in axes if n == "batch" or a not in zero)) for n, axes in rules)
        return tuple((n, axes) for n, axes in kept if axes)
    plain = PLAIN.get(lay.name) or _layout_text(strip(lay.params), strip(lay.opt_state), lay.activations,
                                                strip(lay.grads))
    over = ", ".join(f"{a}=1" for a in zero)
    cost = "12 B/param (fp32 params and Adam moments) on every device"
    if run.model is not None:
        state = sum(math.prod(s) * i * c / _n(shape, _axes_of(lay, a, t)) for _, s, i, a in _leaves(run.model)
                    for t, c in (("params", 1), ("opt_state", 2)))
        cost = f"{_mib(state)} of params and Adam moments per device"
    cost += (f", the same as {plain!r}: the sharding rules meet axes of size 1, so nothing is saved "
             f"(and no collective is added either)")
    fix = _override("layout", plain) + " (the same run, named for what it does"
    src = [a for a in ("data", "fsdp") if a not in zero and shape[a] > 1]
    if src:
        new = {**shape, zero[0]: shape[src[0]], src[0]: 1}
        fix += f"; to shard instead, move the devices onto {zero[0]}: {_override('mesh.shape', _mesh_text(new))}"
        if run.dcn and run.dcn[src[0]] > 1:
            dcn = {**run.dcn, zero[0]: run.dcn[src[0]], src[0]: 1}
            fix += " " + _override("mesh.dcn", mesh_lib.format_factors(dcn))
    return [Finding("zero-saves-nothing", "warning",
                    f"layout {lay.name!r} shards weights, gradients or optimizer moments over {'/'.join(zero)}, but the "
                    f"mesh has {over} ({_mesh_text(shape)})", cost, fix + ")")]


def _unused(run: _Run) -> list[Finding]:
    lay, shape = run.layout, run.shape
    idle = [a for a in AXES if shape[a] > 1 and a not in _named_axes(lay)]
    if not idle:
        return []
    big = {a for a in AXES if shape[a] > 1}
    fits = [name for name, (needs, may) in layouts.presets.PRESET_AXES.items() if needs <= big <= may]
    # Keep the layout's kind where one fits (zero1 stays zero1, fsdp stays fsdp).
    fits.sort(key=lambda name: name.split("_")[0] != lay.name.split("_")[0])
    fix = _override("layout", fits[0]) if fits else (
        f"no preset uses {_mesh_text(shape)}: put the devices on the axes layout {lay.name!r} names, "
        f"or write rules for {', '.join(idle)} (docs/layouts.md)")
    n = _n(shape, idle)
    return [Finding("unused-axis", "warning",
                    f"mesh {_mesh_text(shape)} has {' x '.join(f'{a}={shape[a]}' for a in idle)}, which layout "
                    f"{lay.name!r} never names: the {n} devices along {'+'.join(idle)} hold the same weights "
                    f"and compute the same rows",
                    f"{n}x the work per step for the same result: {n - 1} of every {n} devices add nothing",
                    fix)]
