"""The linter's checks for mixtures of experts (planner/lint.py runs them):

  experts-indivisible (error) model.num_experts is not divisible by the product of the mesh
                      axes the layout gives `experts` (in any table): every device must hold
                      whole experts; validation refuses it (experiment.validate). The fix moves
                      the expert axis's surplus to data, or names a num_experts that divides
  capacity-drops      (warning) moe.dispatch=capacity with a capacity factor whose expected
                      share of routed copies dropped in the first steps is over DROP_LIMIT:
                      the router is near uniform at initialisation, so each expert gets
                      Binomial(T, k/X) of a sequence's copies and drops those past
                      C = ceil(k T factor / X) (planner/experts.drop_share, exact for uniform
                      routing). The fix: the least factor (to 0.05) whose estimate is under
                      the limit / FIX_MARGIN, or dropless. Mixtral tiny (T 128, X 4, k 2):
                      factor 1.0 expects 3.5%, the first 10 steps of mixtral_tiny_dp8 measured
                      5.3% (moe_dropped); the fix's 1.15 expects 0.13% and measured 0.82%:
                      an initial router is near uniform, not uniform, and the estimate is a floor.
"""

from __future__ import annotations

from meshtrain.models import moe
from meshtrain.planner import experts
from meshtrain.planner.findings import Finding, Run, axes_text, override, surplus_to_data
from meshtrain.planner.split_cost import split_over

DROP_LIMIT = 0.01  # the largest expected share of routed copies dropped not flagged
# The fix aims the uniform estimate this far under the limit: an initial router is not
# quite uniform: mixtral_tiny_dp8 measured 1.5x the estimate at factor 1.0 (5.3% against 3.5%), 6x in the
# thin tail at 1.15 (0.82% against 0.13%: under the limit, as the fix wants).
FIX_MARGIN = 4


def indivisible(run: Run) -> list[Finding]:
    x = run.dims.get("num_experts")
    if not isinstance(x, int) or x <= 1:
        return []
    n, over = split_over(run.layout, run.shape, "experts", target=None)
    if x % n == 0:
        return []
    return [Finding("experts-indivisible", "error",
                    f"layout {run.layout.name!r} splits the model.num_experts={x} experts over "
                    f"{axes_text(run.shape, over)} = {n} devices, which does not divide {x}",
                    "the run cannot start: validation refuses experts that do not split evenly (every "
                    "device holds whole experts)",
                    f"{surplus_to_data(run, 'expert', over, x, 'num_experts')} (or a model with num_experts a "
                    f"multiple of {n}, e.g. {-(-x // n) * n})")]


def capacity_drops(run: Run) -> list[Finding]:
    d, keys = run.dims, run.cfg.get("moe")
    x, k, t = d.get("num_experts"), d.get("experts_per_token"), d.get("seq_len")
    if keys is None or keys.dispatch != "capacity" or not all(isinstance(v, int) for v in (x, k, t)) or x <= 1:
        return []
    factor = keys.capacity_factor
    share = experts.drop_share(t, x, k, factor)
    if share <= DROP_LIMIT:
        return []
    better = experts.factor_for(t, x, k, DROP_LIMIT / FIX_MARGIN)
    slots = moe.capacity(t, x, k, factor)
    return [Finding("capacity-drops", "warning",
                    f"moe.capacity_factor={factor:g} gives each expert C = ceil(k T factor / X) = {slots} slots "
                    f"per sequence (k={k}, T={t}, X={x}): with the near-uniform router of the first steps, "
                    f"{share:.1%} of the routed copies are expected to be dropped (over {DROP_LIMIT:.0%})",
                    f"{share:.1%} of the copies skip their expert (their token keeps its other choices); a "
                    f"sharded run still equals one device, but the model trains on fewer expert updates "
                    f"(uniform-routing estimate, planner/experts.py: a floor; Mixtral tiny measured 1.5x it at factor 1.0)",
                    f"{override('moe.capacity_factor', better)} (expected {experts.drop_share(t, x, k, better):.2%} "
                    f"dropped; or {override('moe.dispatch', 'dropless')}, which drops none)")]
