"""The optimizers (optim.name = adamw | sgd | lars | lamb), their lr schedule (warm-up,
cosine or constant, the linear scaling rule), gradient clipping and the decay mask.

Weight decay applies to matrices only: parameters with at least two logical axes besides
the stacked `layers`/`stage` axes (attention and MLP weights, embeddings, conv kernels
[kh, kw, in, out]). Biases and LayerNorm/BatchNorm scales and offsets are not decayed (as
GPT-2 / nanoGPT do for biases and LayerNorm, Goyal et al. 2017 for BatchNorm), and LARS and
LAMB do not rescale them by a trust ratio either (BERT's LAMB, for one, skips layer
adaptation wherever it skips decay): their update is the plain momentum-SGD / Adam step.

The trust ratio of LARS and LAMB is per layer: meshtrain stores the blocks' weights
stacked [layers, ...] (or [stage, layers per stage, ...] under a pipeline) in one array,
and optax's `scale_by_trust_ratio` would take one norm over the whole stack. Here the
norms reduce over every axis but `layers`/`stage`, so a stacked weight gets the ratio each
of its layers would get on its own (tests/test_optim_sharded.py checks it against optax
per slice).

optim.mu_dtype stores the first moment (Adam's mu, the momentum buffer of SGD and LARS)
in another dtype (bfloat16 halves its bytes); Adam's second moment stays in the param
dtype, since bfloat16's 8-bit mantissa loses the small squared gradients it sums
(docs/performance.md gives the cost in loss). docs/optimizers.md has the keys and recipes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import optax

from meshtrain.errors import UserError
from meshtrain.models.stack import is_matrix
from meshtrain.parallel.momentum_compression import frozen_variance_adam

NAMES = ("adamw", "sgd", "lars", "lamb")
SCHEDULES = ("cosine", "constant")
MU_DTYPES = ("", "float32", "bfloat16")
STACKED = ("layers", "stage")


def check_config(o: ml_collections.ConfigDict) -> None:
    """Every optim.* value on its own; `schedule` calls it, so experiment.validate raises
    these before anything is traced."""
    if o.name not in NAMES:
        raise UserError(f"optim.name={o.name!r}: the optimizers are {', '.join(NAMES)} "
                        f"(docs/optimizers.md). E.g. --config.optim.name=lamb.")
    if o.schedule not in SCHEDULES:
        raise UserError(f"optim.schedule={o.schedule!r}: choose one of {', '.join(SCHEDULES)}.")
    if o.lr <= 0 or o.min_lr < 0 or o.min_lr > o.lr:
        raise UserError(f"optim.lr={o.lr}, optim.min_lr={o.min_lr}: need 0 <= min_lr <= lr and lr > 0.")
    if o.mu_dtype not in MU_DTYPES:
        raise UserError(f"optim.mu_dtype={o.mu_dtype!r}: choose bfloat16, float32, or \"\" for the "
                        f"param dtype.")
    if o.weight_decay < 0:
        raise UserError(f"optim.weight_decay={o.weight_decay}: need >= 0 (0: no decay).")
    if o.lr_batch_size < 0:
        raise UserError(f"optim.lr_batch_size={o.lr_batch_size}: need >= 0 (0: optim.lr as given; "
                        f"N: optim.lr is the lr for a batch of N and is scaled by train.batch_size / N).")
    if o.eps < 0:
        raise UserError(f"optim.eps={o.eps}: need >= 0.")
    if o.name in ("sgd", "lars"):
        if not 0 <= o.momentum < 1:
            raise UserError(f"optim.momentum={o.momentum} (optim.name={o.name}): need 0 <= momentum < 1 "
                            f"(0: no momentum; the survey's and Goyal et al.'s SGD use 0.9).")
        if o.nesterov and o.momentum == 0:
            raise UserError("optim.nesterov=True with optim.momentum=0: Nesterov's look-ahead needs "
                            "momentum. Set --config.optim.momentum=0.9, or nesterov=false.")
        if o.mu_dtype and o.momentum == 0:
            raise UserError(f"optim.mu_dtype={o.mu_dtype!r} with optim.name={o.name} and momentum 0: "
                            f"there is no momentum buffer to store. Leave optim.mu_dtype=\"\".")
    else:
        if o.nesterov:
            raise UserError(f"optim.nesterov=True applies to sgd and lars, not {o.name} (its first "
                            f"moment is optim.b1). Leave optim.nesterov=false, or use optim.name=sgd.")
        for key in ("b1", "b2"):
            if not 0 <= o[key] < 1:
                raise UserError(f"optim.{key}={o[key]} (optim.name={o.name}): need 0 <= {key} < 1.")
    if o.name == "lars" and o.trust_coefficient <= 0:
        raise UserError(f"optim.trust_coefficient={o.trust_coefficient}: LARS needs > 0 (You et al. "
                        f"2017 use 0.001).")


def peak_lr(o: ml_collections.ConfigDict, batch_size: int | None) -> tuple[float, float]:
    """(lr, min_lr) after the linear scaling rule (Goyal et al. 2017, arXiv 1706.02677):
    with optim.lr_batch_size = N > 0, optim.lr is the lr of a batch of N examples and a
    step of `batch_size` (train.batch_size, the global batch of one optimizer step) uses
    lr x batch_size / N; min_lr scales alike, so the schedule keeps its shape."""
    if not o.lr_batch_size:
        return o.lr, o.min_lr
    if batch_size is None:
        raise ValueError("optim.lr_batch_size is set: pass the global batch size (train.batch_size).")
    k = batch_size / o.lr_batch_size
    return o.lr * k, o.min_lr * k


def schedule(o: ml_collections.ConfigDict, total_steps: int, batch_size: int | None = None) -> optax.Schedule:
    """Linear warmup from 0 to the peak lr (optim.lr, scaled by `peak_lr`), then cosine to
    min_lr at total_steps (or constant). Checks every optim.* key first (check_config)."""
    check_config(o)
    lr, min_lr = peak_lr(o, batch_size)
    warmup = max(0, min(int(o.warmup_steps), total_steps))
    if o.schedule == "constant":
        return optax.join_schedules(
            [optax.linear_schedule(0.0, lr, max(warmup, 1)), optax.constant_schedule(lr)], [warmup])
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=lr, warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1), end_value=min_lr)


def describe(o: ml_collections.ConfigDict, total_steps: int, stop_at: int = 0,
             batch_size: int | None = None) -> tuple[str, list[str]]:
    """The schedule in one line, and warnings where warm-up or decay does not fit in
    `total_steps` (train.steps): -> (line, [warning, ...]). `batch_size` (train.batch_size)
    is needed when optim.lr_batch_size is set; the line gives the scaled lr and its sum."""
    warmup = int(o.warmup_steps)
    sched = schedule(o, total_steps, batch_size)
    lr, min_lr = peak_lr(o, batch_size)
    peak = f"{lr:g}"
    if o.lr_batch_size:
        peak += (f" (optim.lr {o.lr:g} x train.batch_size {batch_size} / optim.lr_batch_size "
                 f"{o.lr_batch_size}, linear scaling)")
    if warmup >= total_steps:
        shape = f"warm-up 0 -> {peak} over all {total_steps} steps, no decay"
    else:
        rise = f"warm-up 0 -> {peak} over {warmup} steps, " if warmup else f"{peak} from step 1, "
        shape = rise + (f"cosine to {min_lr:g} at step {total_steps}" if o.schedule == "cosine" else "then constant")
    named = "" if o.name == "adamw" else f"optim.name={o.name}, "
    line = f"lr: {shape} ({named}optim.schedule={o.schedule})"
    if stop_at:
        line += f"; this run stops at step {stop_at} (train.stop_at), lr {float(sched(stop_at)):.3g} there"
    warnings = []
    if warmup >= total_steps > 0:
        warnings.append(
            f"optim.warmup_steps={warmup} is not less than train.steps={total_steps}: the warm-up "
            f"takes the whole run (cut to {total_steps} steps): the lr rises all the way, never holds "
            f"at its peak {lr:g} and never decays. Use fewer warm-up steps, e.g. "
            f"--config.optim.warmup_steps={max(total_steps // 10, 1)} (a tenth of the run).")
    elif o.schedule == "cosine" and warmup > total_steps // 2:
        warnings.append(
            f"optim.warmup_steps={warmup} is more than half of train.steps={total_steps}: the cosine "
            f"decay to {min_lr:g} has only {total_steps - warmup} steps. Use fewer "
            f"warm-up steps, e.g. --config.optim.warmup_steps={max(total_steps // 10, 1)}.")
    return line, warnings


def _is_axes(x) -> bool:
    return isinstance(x, tuple)


def decay_mask(axes_tree) -> dict:
    """True for parameters that get weight decay (and a LARS/LAMB trust ratio): matrices,
    embeddings and conv kernels. `axes_tree` mirrors params with axis tuples."""
    return jax.tree.map(is_matrix, axes_tree, is_leaf=_is_axes)


def moment_dtypes(o: ml_collections.ConfigDict, param_dtype) -> list:
    """The dtypes of the per-parameter optimizer state, one per params-shaped buffer
    (what a memory formula counts): Adam's mu and nu, the momentum buffer, or none."""
    mu = o.mu_dtype or param_dtype
    if o.name in ("adamw", "lamb"):
        return [mu, param_dtype]
    return [mu] if o.momentum else []


def scale_by_layer_trust_ratio(axes_tree, trust_coefficient: float = 1.0,
                               eps: float = 0.0) -> optax.GradientTransformation:
    """optax.scale_by_trust_ratio per layer, and only for decayed parameters (decay_mask):
    u -> u x coef ||p|| / (||u|| + eps), the norms over every axis but layers/stage (a
    stacked [L, ...] weight gets L ratios, shape [L, 1, ...]); a ratio of 1 where either
    norm is 0, as optax does. Stateless; needs params."""
    def update(updates, state, params=None):
        if params is None:
            raise ValueError("scale_by_layer_trust_ratio needs params: tx.update(grads, state, params).")
        leaves, treedef = jax.tree.flatten(updates)
        ps, axes = treedef.flatten_up_to(params), treedef.flatten_up_to(axes_tree)

        def scale(u, p, ax):
            if not is_matrix(ax) or u.size == 0:  # (a zero-size stand-in: parallel/offload.py)
                return u
            # the trailing dims, those not stacked: a stacked [L, ...] weight, or one layer's
            # slice of it (host offload's streamed update, parallel/offload.py)
            n = sum(a not in STACKED for a in ax)
            over = tuple(range(u.ndim - n, u.ndim))
            p_norm = jnp.sqrt(jnp.sum(jnp.square(p), axis=over, keepdims=True))
            u_norm = jnp.sqrt(jnp.sum(jnp.square(u), axis=over, keepdims=True))
            ratio = trust_coefficient * p_norm / (u_norm + eps)
            return u * jnp.where((p_norm == 0) | (u_norm == 0), jnp.ones((), p.dtype), ratio).astype(u.dtype)
        return treedef.unflatten([scale(u, p, a) for u, p, a in zip(leaves, ps, axes)]), state
    return optax.GradientTransformation(lambda _: optax.EmptyState(), update)


def _transform(o: ml_collections.ConfigDict, lr: optax.Schedule, axes_tree,
               freeze_variance_at: int | None = None) -> optax.GradientTransformation:
    mask = decay_mask(axes_tree)
    mu = o.mu_dtype or None
    if o.name == "adamw" and freeze_variance_at is not None:  # optax.adamw's chain, its variance frozen
        return optax.chain(frozen_variance_adam(o.b1, o.b2, o.eps, freeze_variance_at, mu),
                           optax.add_decayed_weights(o.weight_decay, mask), optax.scale_by_learning_rate(lr))
    if o.name == "adamw":  # decoupled decay (Loshchilov & Hutter), scaled by the lr
        return optax.adamw(lr, b1=o.b1, b2=o.b2, eps=o.eps, mu_dtype=mu,
                           weight_decay=o.weight_decay, mask=mask)
    if o.name == "sgd":
        # Coupled L2, as PyTorch's SGD weight_decay (the survey's VGG recipe): wd x p is added
        # to the gradient before the momentum buffer, so it is carried by momentum.
        return optax.chain(optax.add_decayed_weights(o.weight_decay, mask),
                           optax.sgd(lr, momentum=o.momentum or None, nesterov=o.nesterov,
                                     accumulator_dtype=mu))
    if o.name == "lars":  # optax.lars's chain, with a per-layer, masked trust ratio
        return optax.chain(optax.add_decayed_weights(o.weight_decay, mask),
                           scale_by_layer_trust_ratio(axes_tree, o.trust_coefficient, o.eps),
                           optax.scale_by_learning_rate(lr),
                           optax.trace(decay=o.momentum, nesterov=o.nesterov, accumulator_dtype=mu)
                           if o.momentum else optax.identity())
    # lamb: optax.lamb's chain (Adam, decoupled decay inside the trust ratio), per layer, masked
    return optax.chain(optax.scale_by_adam(b1=o.b1, b2=o.b2, eps=o.eps, mu_dtype=mu),
                       optax.add_decayed_weights(o.weight_decay, mask),
                       scale_by_layer_trust_ratio(axes_tree),
                       optax.scale_by_learning_rate(lr))


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
    """optax.clip_by_global_norm, taking the norm as `update(..., global_norm=n)` where the
    caller has it: the train step passes the norm it logs (one sum of squares a leaf,
    train_step.norm_and_nonfinite), so an update that sees one layer at a time
    (offload.streamed_update) clips exactly as the whole step does, and the norm is not
    summed twice. Two sums of the same squares in different orders differ in the last bit,
    which put the two updates 1 ulp apart whenever the clip acted. Without `global_norm`
    (DiLoCo's per-replica inner steps) it is optax's. Its state is optax's (EmptyState):
    checkpoints do not change."""
    def update(updates, state, params=None, *, global_norm=None, **extra_args):
        del params, extra_args
        norm = optax.tree.norm(updates) if global_norm is None else global_norm
        keep = jnp.squeeze(norm < max_norm)
        return jax.tree.map(lambda t: jax.lax.select(keep, t, (t / norm.astype(t.dtype)) * max_norm), updates), state
    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update)


def make(o: ml_collections.ConfigDict, lr: optax.Schedule, axes_tree,
         freeze_variance_at: int | None = None) -> optax.GradientTransformation:
    """optim.name following the `lr` schedule (see `schedule`), after clipping the global
    gradient norm to optim.grad_clip (0: off), with the decay mask. `freeze_variance_at`:
    Adam's second moment stops changing after that many updates (train.compress_momentum,
    parallel/momentum_compression.py)."""
    check_config(o)
    parts = []
    if o.grad_clip and o.grad_clip > 0:
        parts.append(clip_by_global_norm(o.grad_clip))
    parts.append(_transform(o, lr, axes_tree, freeze_variance_at))
    return optax.chain(*parts)
