"""Whether the compiled train step fits the memory its devices have, checked after
compiling and before anything is allocated; when it does not, the cheapest fixes the
planner knows, each estimated before it is suggested.

    check(exp, metrics.memory_report(compiled), say)   # raises UserError when it cannot fit

The budget (what each device has: the device's own memory, or on CPU the host's RAM shared
by its simulated devices, with a margin) is read where the run starts, run/memory_budget.py.
XLA's peak estimate (argument + output + temp - alias, per device) must fit it.

Fixes (`find_fix`): one change at a time, cheapest first (`candidates`), then combined;
each is built (what does not divide is dropped), estimated by the planner's formulas
(planner/analytic.py: a floor on CPU, whose compiler keeps float32 copies of bf16
activations) and, when the formulas say it may fit, compiled here until one fits or the
time budget is spent.
"""

from __future__ import annotations

import copy
import dataclasses
import socket
import time

from meshtrain import config as config_lib, mesh as mesh_lib
from meshtrain.errors import UserError, gib, warn
from meshtrain.run.memory_budget import Budget, arithmetic, fits, host_budget, local_budget

FIX_COMPILE_BUDGET_S = 60.0  # compiling candidate fixes stops after this (then formulas only)

# layout preset -> (the preset that shards the optimizer state only, the one that shards everything over fsdp)
SHARDED = {"dp": ("zero1", "fsdp"), "zero1": (None, "fsdp"), "zero2": (None, "fsdp"), "dp_tp": (None, "fsdp_tp"),
           "dp_pp": ("zero1_pp", "fsdp_pp"), "zero1_pp": (None, "fsdp_pp"), "zero2_pp": (None, "fsdp_pp"),
           "dp_pp_tp": (None, "fsdp_pp_tp")}


def check_config(t) -> None:
    """train.skip_memory_check: a bool (the override parser keeps the type; a config file may not)."""
    if not isinstance(t.skip_memory_check, bool):
        raise UserError(f"train.skip_memory_check={t.skip_memory_check!r}: must be true or false.")


@dataclasses.dataclass
class Fix:
    overrides: tuple[tuple[str, str], ...]
    cost: str
    formula: float | None = None   # bytes per device by planner/analytic.py
    compiled: float | None = None  # XLA's peak estimate, when compiled here

    def flags(self) -> str:
        return " ".join(f"--config.{k}={v}" for k, v in self.overrides)


def candidates(cfg, shape: dict[str, int], dcn: dict[str, int] | None) -> list[Fix]:
    """The planner's levers, one at a time cheapest first, then combined; `shape` and
    `dcn` are the run's resolved mesh (the layout fixes move its data axis to fsdp)."""
    t, m = cfg.train, cfg.model
    k = t.grad_accum_steps
    micro = [Fix((("train.grad_accum_steps", str(k * f)),), f"the same update in {f}x as many smaller passes")
             for f in (2, 4, 8)]
    zero1, fsdp = SHARDED.get(cfg.layout, (None, None))
    save_dots = Fix((("model.remat", "save_dots"),), "recomputes element-wise ops in backward, ~10% more compute")
    full = Fix((("model.remat", "full"),), "recomputes each layer in backward, ~33% more compute")
    one_f_one_b = pipeline_fixes(cfg, shape)
    out = one_f_one_b[:1] + ([save_dots] if m.remat == "none" else []) + one_f_one_b[1:]
    out.append(micro[0])
    if zero1:
        out.append(Fix((("layout", zero1),), "shards the optimizer state over data, no more traffic"))
    if m.remat != "full":
        out.append(full)
    out.append(micro[1])
    sharded = None
    if fsdp:
        moved = {**shape, "fsdp": shape["fsdp"] * shape["data"], "data": 1}
        over = (("layout", fsdp), ("mesh.shape", mesh_lib.format_factors(moved)))
        if dcn and dcn["data"] > 1:
            over += (("mesh.dcn", mesh_lib.format_factors({**dcn, "fsdp": dcn["fsdp"] * dcn["data"], "data": 1})),)
        sharded = Fix(over, "shards params and optimizer state over fsdp, gathers weights per layer")
        out.append(sharded)
    out.append(micro[2])
    strongest = ([full] if m.remat != "full" else []) + ([sharded] if sharded else [])
    for extra in ([], [micro[0]], [micro[1]], [micro[2]]):
        if len(strongest + extra) > 1:
            out.append(_together(strongest + extra))
    for f in (2, 4):
        if t.batch_size % f == 0:
            out.append(Fix((("train.batch_size", str(t.batch_size // f)),),
                           f"changes the run: {f}x fewer tokens a step (retune optim.lr)"))
    return out


def pipeline_fixes(cfg, shape: dict[str, int]) -> list[Fix]:
    """A gpipe or circular run's 1F1B counterpart (interleaved for circular), keeping each
    stage's microbatches only between their forward and backward slots: with autodiff's
    residuals (no more compute), then with the stage inputs alone (docs/pipeline.md)."""
    p = cfg.pipeline
    if shape.get("stage", 1) <= 1 or p.microbatches <= 0 or p.schedule not in ("gpipe", "circular"):
        return []
    schedule = ("pipeline.schedule", "1f1b" if p.schedule == "gpipe" else "interleaved")
    kept = f"keeps at most 2S-1 = {2 * shape['stage'] - 1} microbatches per stage, not M = {p.microbatches}"
    return [Fix((schedule, ("pipeline.stash", "residuals")), f"{kept}, the same compute"),
            Fix((schedule, ("pipeline.stash", "inputs")),
                f"{kept}, each as its stage input alone; recomputes each stage's forward in backward, "
                f"~33% more layer compute")]


def _together(fixes: list[Fix]) -> Fix:
    return Fix(sum((f.overrides for f in fixes), ()), "; ".join(f.cost for f in fixes))


def find_fix(exp, budget: Budget, time_budget_s: float = FIX_COMPILE_BUDGET_S) -> tuple[Fix | None, list[Fix]]:
    """(the cheapest candidate that fits, compiled here, or None; the cheaper ones tried)."""
    from meshtrain.planner import analytic
    from meshtrain.run.experiment import Experiment, Inputs
    from meshtrain.runlog import metrics
    inputs = Inputs(exp.init, exp.source)
    deadline = time.perf_counter() + time_budget_s
    tried = []
    for fix in candidates(exp.cfg, dict(exp.mesh.shape), exp.dcn):
        cfg = copy.deepcopy(exp.cfg)
        try:
            for key, value in fix.overrides:
                config_lib.override(cfg, key, value)
            other = Experiment.build(cfg, inputs=inputs)
        except UserError:
            continue  # does not divide, or the layout cannot hold it: not a fix for this config
        fix.formula = sum(v or 0.0 for v in analytic.memory(other).values())
        if fits(fix.formula, budget) and time.perf_counter() < deadline:
            fix.compiled = metrics.memory_report(other.compile(analysis=True)).get("peak_estimate")
            if fix.compiled is not None and fits(fix.compiled, budget):
                return fix, tried
        tried.append(fix)
    return None, tried


def explain(peak: float, budget: Budget, fix: Fix | None, tried: list[Fix], who: str = "") -> str:
    """The one paragraph a run that cannot fit stops with."""
    head = (f"{who}the compiled train step needs {gib(peak)} per device (XLA's peak estimate: arguments "
            f"+ outputs + temporaries - aliased) and cannot fit: {arithmetic(peak, budget)}.")
    if fix is not None:
        total = f", {budget.sharing} x {gib(fix.compiled)} = {gib(fix.compiled * budget.sharing)}" \
            if budget.host else ""
        fixes = (f" The cheapest fix the planner knows that fits, compiled here: {fix.flags()} ({fix.cost}): "
                 f"{gib(fix.compiled)} per device{total}.")
    else:
        fixes = (" None of the planner's fixes fits (1F1B for a pipeline, remat, gradient accumulation, an "
                 "fsdp layout, a smaller batch, and those combined): the run needs more devices, or devices "
                 "with more memory; `meshtrain plan --search --devices=N` ranks the layouts for N devices.")
    if tried:
        fixes += (" Not enough " + ("alone" if fix is not None else "either") + " (per device, compiled where "
                  "marked, else by the planner's formulas, which on CPU are a floor): "
                  + "; ".join(f"{f.flags()} {gib(f.compiled if f.compiled is not None else f.formula)}"
                              + (" compiled" if f.compiled is not None else "") for f in tried) + ".")
    return (head + fixes + " --config.train.steps=0 compiles a change and prints its figure without "
            "training; --config.train.skip_memory_check=true starts anyway, for those who know better "
            "(swap, or an estimate known to be pessimistic).")


def _check_host_share(peak: float, host: float, budget: Budget, warn_only: bool) -> None:
    """train.offload's state in host memory: every device this host drives keeps its share
    there. Refuse (or warn) when that cannot fit the host's RAM; no compute lever fixes it."""
    room = budget if budget.host else host_budget(budget)
    if room is None:
        return
    total = host + (peak if budget.host else 0.0)
    if fits(total, room):
        return
    what = (f"train.offload keeps {gib(host)} per device in host memory"
            + (f" beside the step's {gib(peak)}" if budget.host else ""))
    paragraph = (f"{what} and cannot fit: {arithmetic(total, room)}. Offload less (train.offload=opt_state "
                 f"keeps the parameters on the device), shard the state over more devices (an fsdp "
                 f"layout), or use hosts with more memory; --config.train.skip_memory_check=true starts anyway.")
    if warn_only:
        warn(paragraph)
    else:
        raise UserError(paragraph)


def check(exp, memory: dict, say, *, skip: bool = False, compile_only: bool = False,
          budget: Budget | None = None, time_budget_s: float = FIX_COMPILE_BUDGET_S) -> bool:
    """Compares the compiled per-device peak (`memory`: metrics.memory_report) with this
    process's budget (default memory_budget.local_budget). Fits: one line through `say`, True.
    Does not: a UserError with `explain`'s paragraph; a warning instead when `skip`
    (the arithmetic only) or `compile_only` (nothing will be allocated). -> fits."""
    import jax

    peak = memory.get("peak_estimate")
    if budget is None:
        budget = local_budget()
    if peak is None or budget is None:
        say("memory check: " + ("the compiler gives no memory estimate" if peak is None
                                else "the devices report no memory limit") + "; not checked")
        return True
    host = memory.get("host", 0)
    if host:
        _check_host_share(peak, host, budget, skip or compile_only)
    if budget.host:  # simulated devices: the step and the offloaded state share the host's RAM
        peak += host
    if fits(peak, budget):
        say(f"memory check: fits; {arithmetic(peak, budget)}")
        return True
    who = f"process {jax.process_index()} ({socket.gethostname()}): " if jax.process_count() > 1 else ""
    if skip:
        warn(f"{who}the compiled train step needs {gib(peak)} per device and may not fit: "
             f"{arithmetic(peak, budget)}. Starting anyway (train.skip_memory_check=true).")
        return False
    fix, tried = find_fix(exp, budget, time_budget_s)
    paragraph = explain(peak, budget, fix, tried, who)
    if compile_only:
        warn(paragraph.replace(" and cannot fit:", " and would not fit (a run stops here):", 1))
        return False
    raise UserError(paragraph)
