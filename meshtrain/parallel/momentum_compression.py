"""The momentum compressed instead of the gradient (train.compress_momentum): 1-bit Adam's
form (Tang et al. 2021, arXiv 2102.02888) of train.grad_compression.

Compressing the gradient puts error feedback before the optimizer's momentum, which
multiplies what the buffers pay back by up to 1 / (1 - b1) and, under Adam, the variance
squares the compression's error (docs/performance.md measures both). Here each data
replica compresses its own next momentum instead. The replicas share the momentum m, so
with c = b1 / (1 - b1) for Adam's first moment (u = b1 m + (1 - b1) g) or c = the momentum
for SGD's trace (u = b m + g):

    v_i = g_i + c m          a replica's next momentum, in gradient units
    V   = compressed mean of the v_i (the two phases, error feedback on v)
    g^  = V - c m            what the step hands the optimizer

so that the optimizer's own update, b1 m + (1 - b1) g^ (or b m + g^), is the compressed
momentum itself, and every replica holds it. Nothing else changes: the bytes across
nodes are the gradient compression's.

Adam's variance is frozen after `warmup` steps (`frozen_variance_adam`), and those
first steps reduce exactly (the replicas' gradients summed in float32, as
train.grad_dtype=float32 does; the feedback buffers stay zero), as 1-bit Adam warms up: a
variance learned from compressed values would be the compression's error squared. The two
reductions are two programs (step/programs.py's Phased), not a `lax.cond` in one, so that
the compressed step's HLO, which the planner reads, holds only the compressed collectives.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from meshtrain.errors import UserError
from meshtrain.parallel import compression, grad_reduce

FIELDS = {"adamw": "mu", "sgd": "trace"}  # the optimizer state's momentum, by optim.name


@dataclasses.dataclass(frozen=True)
class Momentum:
    """Where the momentum is (`field`: its name in the optax state) and how the gradient is
    shifted to become it (`coefficient`: c above); `warmup`: steps reduced exactly first."""

    field: str
    coefficient: float
    warmup: int

    def offset(self, opt_state):
        """c m, a float32 tree like the params (m: the optimizer state's momentum)."""
        m = optax.tree_utils.tree_get(opt_state, self.field)
        return jax.tree.map(lambda x: self.coefficient * x.astype(jnp.float32), m)


def reduce(grads_n, params, comm, comp, mesh: Mesh, replicas: tuple[str, ...], specs, shift=None):
    """grads [n, ...] (each replica's mean gradient, split over `replicas`) -> (their mean
    under train.grad_compression (`comp`: compression.Compression), split as `specs`; the
    feedback buffers `comm` after the step). With `shift` (c m, like the params) each
    replica's gradient is moved by c m before the compressed mean and the mean moved back
    (module docstring)."""
    if shift is None:
        return compression.reduce(grads_n, params, comp, mesh, replicas, specs, comm)
    moved = jax.tree.map(lambda g, o: (g.astype(jnp.float32) + o[None]).astype(g.dtype), grads_n, shift)
    mean, comm = compression.reduce(moved, params, comp, mesh, replicas, specs, comm)
    return jax.tree.map(lambda g, o: (g.astype(jnp.float32) - o).astype(g.dtype), mean, shift), comm


def check(train, optim) -> None:
    """The keys alone (cfg.train, cfg.optim): train.grad_compression's, then these."""
    compression.check(train)
    if not isinstance(train.compress_momentum, bool):
        raise UserError(f"train.compress_momentum={train.compress_momentum!r}: must be true or false.")
    if not isinstance(train.compress_warmup, int) or train.compress_warmup < 0:
        raise UserError(f"train.compress_warmup={train.compress_warmup!r}: a count of steps >= 0.")
    if not train.compress_momentum:
        return
    why = None
    if train.grad_compression == "none":
        why = "there is no compression to move (set train.grad_compression=int8 or onebit)"
    elif optim.name not in FIELDS or (optim.name == "sgd" and not optim.momentum):
        why = (f"optim.name={optim.name} has no momentum this form can compress (adamw's first moment, "
               f"or sgd with optim.momentum > 0)")
    elif optim.grad_clip:
        why = (f"optim.grad_clip={optim.grad_clip} would clip the gradient recovered from the compressed "
               f"momentum, and the optimizer's momentum would then no longer be the compressed one "
               f"(set optim.grad_clip=0)")
    elif optim.name == "adamw" and train.compress_warmup == 0:
        why = ("Adam's variance is frozen after train.compress_warmup exact steps, and 0 leaves it at zero "
               "(set train.compress_warmup to a few hundred steps, or about a fifth of the run: 1-bit Adam "
               "warms up for 15-25% of training)")
    elif train.offload:
        why = f"train.offload={train.offload!r} keeps the momentum in host memory, where the step reads it"
    if why:
        raise UserError(f"train.compress_momentum=true: {why}.")


def with_momentum(reduction: grad_reduce.Reduction, train, optim, layout, diloco_on: bool) -> grad_reduce.Reduction:
    """The run's Reduction (grad_reduce.of_run's) with train.compress_momentum's Momentum
    on its compression."""
    if diloco_on and train.compress_momentum:
        raise UserError("train.compress_momentum=true with diloco.every > 0: DiLoCo compresses its outer "
                        "step's pseudo-gradient, which has no momentum of the inner optimizer to stand for. "
                        "Set train.compress_momentum=false.")
    momentum = resolve(train, optim, layout)
    if momentum is None or reduction.compression is None:
        return reduction
    return dataclasses.replace(reduction, compression=dataclasses.replace(reduction.compression, momentum=momentum))


def resolve(train, optim, layout) -> Momentum | None:
    """The run's Momentum, or None. Refused under a layout that splits the optimizer state
    over the replicas (ZeRO-1): each replica would gather the momentum every step."""
    check(train, optim)
    if not train.compress_momentum:
        return None
    if layout.opt_state != layout.params:
        raise UserError(
            f"train.compress_momentum=true with layout {layout.name!r}: its optimizer state is split "
            f"differently from the params (ZeRO), so every replica would gather the momentum across the "
            f"data axis each step, uncompressed. Use a layout that keeps the optimizer state with the "
            f"params (dp, dp_tp, fsdp, ...), or compress the gradient (train.compress_momentum=false).")
    coefficient = optim.b1 / (1 - optim.b1) if optim.name == "adamw" else optim.momentum
    return Momentum(FIELDS[optim.name], float(coefficient), train.compress_warmup)


def frozen_variance_at(train) -> int | None:
    """The step after which Adam's variance stays as it is: train.compress_warmup under
    train.compress_momentum (which `check` allows only with a compression), else None
    (optax's Adam)."""
    return train.compress_warmup if train.compress_momentum else None


def frozen_variance_adam(b1: float, b2: float, eps: float, freeze_at: int,
                         mu_dtype=None) -> optax.GradientTransformation:
    """optax.scale_by_adam, whose second moment nu stops changing after `freeze_at` updates
    (and its bias correction with it): until then its updates and state are optax's, to the
    bit (its update, step for step, with one select on nu and one on the count); the state
    is optax's ScaleByAdamState, so checkpoints and `optax.tree_utils.tree_get(state, "mu")`
    read it alike."""
    adam = optax.scale_by_adam(b1=b1, b2=b2, eps=eps, mu_dtype=mu_dtype)

    def update(updates, state, params=None):
        del params
        count = optax.safe_increment(state.count)
        frozen = count > freeze_at
        mu = optax.tree.update_moment(updates, state.mu, b1, 1)
        nu = jax.tree.map(lambda old, new: jnp.where(frozen, old, new), state.nu,
                          optax.tree.update_moment_per_elem_norm(updates, state.nu, b2, 2))
        mu_hat = optax.tree.bias_correction(mu, b1, count)
        nu_hat = optax.tree.bias_correction(nu, b2, jnp.where(frozen, jnp.asarray(freeze_at, count.dtype), count))
        out = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu_hat, nu_hat)
        return out, state._replace(count=count, mu=optax.tree.cast(mu, mu_dtype), nu=optax.tree.cast_like(nu, state.nu))
    return optax.GradientTransformation(adam.init, update)
