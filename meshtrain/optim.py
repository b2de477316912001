"""AdamW with warmup + cosine (or constant) schedule, clipping and a decay mask.

optim.mu_dtype stores Adam's first moment in another dtype (bfloat16 halves its bytes);
the second moment stays in the param dtype, since bfloat16's 8-bit mantissa loses the
small squared gradients it sums (docs/performance.md gives the cost in loss).

Weight decay applies to matrices and embeddings only: parameters with at least two
logical axes besides the stacked `layers`/`stage` axes. Biases and LayerNorm
parameters are not decayed (as in GPT-2 / nanoGPT).
"""

from __future__ import annotations

import jax
import ml_collections
import optax

from meshtrain.errors import UserError
from meshtrain.models.stack import is_matrix

SCHEDULES = ("cosine", "constant")
MU_DTYPES = ("", "float32", "bfloat16")


def schedule(o: ml_collections.ConfigDict, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to optim.lr, then cosine to optim.min_lr at total_steps."""
    if o.schedule not in SCHEDULES:
        raise UserError(f"optim.schedule={o.schedule!r}: choose one of {', '.join(SCHEDULES)}.")
    if o.lr <= 0 or o.min_lr < 0 or o.min_lr > o.lr:
        raise UserError(f"optim.lr={o.lr}, optim.min_lr={o.min_lr}: need 0 <= min_lr <= lr and lr > 0.")
    warmup = max(0, min(int(o.warmup_steps), total_steps))
    if o.schedule == "constant":
        return optax.join_schedules(
            [optax.linear_schedule(0.0, o.lr, max(warmup, 1)), optax.constant_schedule(o.lr)], [warmup])
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=o.lr, warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1), end_value=o.min_lr)


def describe(o: ml_collections.ConfigDict, total_steps: int, stop_at: int = 0) -> tuple[str, list[str]]:
    """The schedule in one line, and warnings where warm-up or decay does not fit in
    `total_steps` (train.steps): -> (line, [warning, ...])."""
    warmup = int(o.warmup_steps)
    lr = schedule(o, total_steps)
    if warmup >= total_steps:
        shape = f"warm-up 0 -> {o.lr:g} over all {total_steps} steps, no decay"
    else:
        rise = f"warm-up 0 -> {o.lr:g} over {warmup} steps, " if warmup else f"{o.lr:g} from step 1, "
        shape = rise + (f"cosine to {o.min_lr:g} at step {total_steps}" if o.schedule == "cosine" else "then constant")
    line = f"lr: {shape} (optim.schedule={o.schedule})"
    if stop_at:
        line += f"; this run stops at step {stop_at} (train.stop_at), lr {float(lr(stop_at)):.3g} there"
    warnings = []
    if warmup >= total_steps > 0:
        warnings.append(
            f"optim.warmup_steps={warmup} is not less than train.steps={total_steps}: the warm-up "
            f"takes the whole run (cut to {total_steps} steps): the lr rises all the way, never holds "
            f"at optim.lr={o.lr:g} and never decays. Use fewer warm-up steps, e.g. "
            f"--config.optim.warmup_steps={max(total_steps // 10, 1)} (a tenth of the run).")
    elif o.schedule == "cosine" and warmup > total_steps // 2:
        warnings.append(
            f"optim.warmup_steps={warmup} is more than half of train.steps={total_steps}: the cosine "
            f"decay to optim.min_lr={o.min_lr:g} has only {total_steps - warmup} steps. Use fewer "
            f"warm-up steps, e.g. --config.optim.warmup_steps={max(total_steps // 10, 1)}.")
    return line, warnings


def decay_mask(axes_tree) -> dict:
    """True for parameters that get weight decay. `axes_tree` mirrors params with axis tuples."""
    return jax.tree.map(is_matrix, axes_tree, is_leaf=lambda x: isinstance(x, tuple))


def make(o: ml_collections.ConfigDict, lr: optax.Schedule, axes_tree) -> optax.GradientTransformation:
    """AdamW following the `lr` schedule (see `schedule`), with clipping and the decay mask."""
    if o.name != "adamw":
        raise UserError(f"optim.name={o.name!r}: the optimizers are: adamw.")
    parts = []
    if o.grad_clip and o.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(o.grad_clip))
    if o.mu_dtype not in MU_DTYPES:
        raise UserError(f"optim.mu_dtype={o.mu_dtype!r}: choose bfloat16, float32, or \"\" for the "
                        f"param dtype.")
    parts.append(optax.adamw(lr, b1=o.b1, b2=o.b2, eps=o.eps, mu_dtype=o.mu_dtype or None,
                             weight_decay=o.weight_decay, mask=decay_mask(axes_tree)))
    return optax.chain(*parts)
