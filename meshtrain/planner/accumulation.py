"""train.accum_gather="auto": whether the step gathers fsdp-sharded params once per step
or in every microbatch, chosen by the planner's memory formula.

    exp, line = resolve(exp)            # before compiling; `line` says which and why
    exp, line = resolve(exp, hardware_budget(hw))   # for a planned device

"once" gathers the params once before the microbatch loop and reduces the accumulated
gradients once after it: 1 gather and 1 reduce-scatter a step instead of about 2k
gathers and k reduce-scatters, for the memory of the gathered params (matrices in the
compute dtype) and a float32 gradient accumulator of their size, both held through the
loop. "auto" takes "once" when the step's per-device memory by the formulas
(analytic.memory, with "once") fits the device budget memory_check uses (the device's
own memory; on CPU the host's RAM shared by the simulated devices), else "each". The
formulas are a floor on CPU, whose compiler keeps float32 copies of bf16 activations:
the compiled memory check after it still has the last word.

Only a step with train.grad_accum_steps > 1 and params sharded over a batch axis has a
choice (grad_reduce.gathered_axes); elsewhere both build the same program.
"""

from __future__ import annotations

from meshtrain.planner import analytic, memory_check
from meshtrain.step import grad_reduce


def hardware_budget(hw) -> memory_check.Budget:
    """The budget of one planned device (planner/hardware.py), its usable share."""
    return memory_check.Budget(hw.hbm_bytes, 1, hw.usable_memory, f"{hw.name}'s memory", host=False)


def choose(exp, budget: memory_check.Budget | None) -> tuple[str, str]:
    """(mode the step builds, why) for `exp`'s train.accum_gather under `budget`."""
    t = exp.cfg.train
    wanted = t.accum_gather
    axes = grad_reduce.gathered_axes(exp.layout, exp.mesh, exp.shardings.params, t.grad_accum_steps, "once")
    if not axes:
        why = ("one microbatch" if t.grad_accum_steps < 2 else
               f"layout {exp.layout.name!r} shards no parameter over a batch axis")
        return wanted if wanted != "auto" else "each", f"nothing to choose: {why}"
    if wanted != "auto":
        return wanted, f"train.accum_gather={wanted}"
    need = sum(v or 0.0 for v in analytic.memory(exp.with_accum_gather("once")).values())
    if budget is None:
        return "each", "auto: the devices report no memory limit to check the extra memory against"
    room = f"{memory_check.gib(need)} per device by the planner's formulas against {memory_check.gib(budget.per_device)}"
    if memory_check.fits(need, budget):
        return "once", f"auto: the gathered params and a float32 accumulator fit, {room}"
    return "each", f"auto: the gathered params and a float32 accumulator do not fit, {room}"


def resolve(exp, budget: memory_check.Budget | None = None, *, local: bool = True):
    """-> (exp with its train step built for the chosen mode, the one line that says so).
    `budget` defaults to this process's devices' (memory_check.local_budget), the least
    over the processes (`agreed`), when `local`."""
    t = exp.cfg.train
    choosing = t.accum_gather == "auto" and grad_reduce.gathered_axes(
        exp.layout, exp.mesh, exp.shardings.params, t.grad_accum_steps, "once")
    if budget is None and local and choosing:  # only then: `agreed` is a collective
        budget = agreed(memory_check.local_budget())
    mode, why = choose(exp, budget)
    if mode != exp.accum_gather:
        exp = exp.with_accum_gather(mode)
    k = exp.cfg.train.grad_accum_steps
    if why.startswith("nothing"):
        what = f"{k} steps, no params to gather"
    elif mode == "once":
        what = (f"{k} steps, params gathered over {'+'.join(analytic.gathered(exp))} once per "
                f"step, gradients reduced once")
    else:
        what = f"{k} steps, params gathered in each"
    return exp, f"gradient accumulation: {what} ({why})"


def agreed(budget: memory_check.Budget | None) -> memory_check.Budget | None:
    """The least per-device budget over all processes, so that every process builds the
    same program (one without a limit: None everywhere). A collective when there are
    several processes; `budget` itself when there is one."""
    import jax
    if jax.process_count() == 1:
        return budget
    import numpy as np
    from jax.experimental import multihost_utils
    each = multihost_utils.process_allgather(np.array(budget.per_device if budget else -1.0))
    if (each < 0).any():
        return None
    return memory_check.Budget(float(each.min()), 1, 1.0, "the least over the processes", host=False)
