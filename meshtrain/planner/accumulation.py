"""train.accum_gather="auto": whether the step gathers fsdp-sharded params once per step
or in every microbatch, chosen by the planner's memory formula.

    exp = Experiment.build(cfg, choose_gather=choose)   # decided against this run's devices
    exp = Experiment.build(cfg, choose_gather=for_hardware(hw))   # for a planned device
    say(line(exp))                      # which, and why

The choice is made from shapes alone (the plan experiment.validate returns), before the
step is built: the step is built once, in the chosen mode.

"once" gathers the params once before the microbatch loop and reduces the accumulated
gradients once after it: 1 gather and 1 reduce-scatter a step instead of about 2k
gathers and k reduce-scatters, for the memory of the gathered params (matrices in the
compute dtype) and a float32 gradient accumulator of their size, both held through the
loop. "auto" takes "once" when the step's per-device memory by the formulas
(analytic.memory, with "once") fits the memory check's device budget (run/memory_budget.py:
the device's own memory; on CPU the host's RAM shared by the simulated devices), else "each". The
formulas are a floor on CPU, whose compiler keeps float32 copies of bf16 activations:
the compiled memory check after it still has the last word.

Only a step with train.grad_accum_steps > 1 and params sharded over a batch axis has a
choice (grad_reduce.gathered_axes); elsewhere both build the same program.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from meshtrain.errors import gib
from meshtrain.parallel import grad_reduce
from meshtrain.planner import analytic
from meshtrain.run.memory_budget import Budget, fits, local_budget


def hardware_budget(hw) -> Budget:
    """The budget of one planned device (planner/hardware.py), its usable share."""
    return Budget(hw.hbm_bytes, 1, hw.usable_memory, f"{hw.name}'s memory", host=False)


def for_hardware(hw) -> Callable:
    """`choose` under the budget of one planned device (`hardware_budget`)."""
    return functools.partial(choose, budget=hardware_budget(hw))


def choose(cfg, mesh, plan, budget: Budget | None = None, *, local: bool = True) -> tuple[str, str]:
    """(the mode the step builds, why) for cfg.train.accum_gather on `mesh` under `plan`
    (experiment.Plan): "auto" decided under `budget`, by default this process's devices'
    (local_budget), the least over the processes (`agreed`), when `local`; None and not
    `local`: no limit known, so "each"."""
    t = cfg.train
    wanted = t.accum_gather
    axes = grad_reduce.gathered_axes(plan.layout, mesh, plan.params, t.grad_accum_steps, "once")
    if not axes:
        why = ("one microbatch" if t.grad_accum_steps < 2 else
               f"layout {plan.layout.name!r} shards no parameter over a batch axis")
        return wanted if wanted != "auto" else "each", f"nothing to choose: {why}"
    if wanted != "auto":
        return wanted, f"train.accum_gather={wanted}"
    once = analytic.abstract_experiment(cfg, plan.model, plan.layout, "once", shape=dict(mesh.shape))
    need = sum(v or 0.0 for v in analytic.memory(once).values())
    if budget is None and local:  # only here, where there is a choice: `agreed` is a collective
        budget = agreed(local_budget())
    if budget is None:
        return "each", "auto: the devices report no memory limit to check the extra memory against"
    room = f"{gib(need)} per device by the planner's formulas against {gib(budget.per_device)}"
    if fits(need, budget):
        return "once", f"auto: the gathered params and a float32 accumulator fit, {room}"
    return "each", f"auto: the gathered params and a float32 accumulator do not fit, {room}"


def line(exp) -> str:
    """The one line that says how `exp` accumulates gradients, and why (exp.accum_why,
    from `choose`)."""
    k = exp.cfg.train.grad_accum_steps
    if exp.accum_why.startswith("nothing"):
        what = f"{k} steps, no params to gather"
    elif exp.accum_gather == "once":
        what = (f"{k} steps, params gathered over {'+'.join(analytic.gathered(exp))} once per "
                f"step, gradients reduced once")
    else:
        what = f"{k} steps, params gathered in each"
    return f"gradient accumulation: {what} ({exp.accum_why})"


def agreed(budget: Budget | None) -> Budget | None:
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
    return Budget(float(each.min()), 1, 1.0, "the least over the processes", host=False)
