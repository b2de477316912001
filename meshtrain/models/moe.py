"""A mixture-of-experts MLP: a top-k router over X experts, each a SwiGLU MLP, with the
router's auxiliary losses, written with logical axis names only.

Routing (Mixtral's, Jiang et al. 2024): router logits [B, T, X] in float32, softmax over
the X experts, the k largest kept and renormalised to sum to 1; a token's output is
sum_j w_j expert_{e_j}(x). Two ways to run the experts (`moe.dispatch`):

  capacity  GShard's einsum form (Lepikhin et al. 2020): each sequence is a group whose
            tokens fill each expert's buffer of C = ceil(k T capacity_factor / X) slots,
            all first choices before any second choice; a token past an expert's C is
            dropped from that expert (its other choices still count) and counted. A
            one-hot dispatch [B, T, X, C] moves tokens into buffers [X, B, C, D]; a layout
            that splits `experts` over a mesh axis and `batch` over the same axis makes
            GSPMD move them with one all-to-all each way. Groups are sequences, so which
            tokens drop never depends on the layout: a sharded run equals one device
            whether or not it drops.
  dropless  every routed copy is computed (models/moe_dropless.py): tokens sorted by
            expert, a grouped matmul per weight (`moe.grouped_matmul`: windows of one
            expert's rows, batched, or `jax.lax.ragged_dot`), written per device under
            shard_map with an all-to-all over the expert axes.

Auxiliary losses, each averaged over layers by the model and added to the training loss:
  load balance (Switch Transformer, Fedus et al. 2022, eq. 4, over k choices as Hugging
      Face's Mixtral): X sum_x f_x P_x, f_x the share of routed copies sent to expert x,
      P_x its mean router probability; k when perfectly balanced.
  router z-loss (ST-MoE, Zoph et al. 2022, eq. 5): mean over tokens of logsumexp(logits)^2.

Shapes: B batch, T length, D embed, X experts, k experts per token, F expert mlp,
C capacity slots per expert and sequence, N = B T tokens.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from meshtrain.errors import UserError
from meshtrain.models import moe_dropless
from meshtrain.models.hook import Hook
from meshtrain.models.stack import param

DISPATCH = ("dropless", "capacity")
# How dropless computes its grouped matmuls (moe_dropless.grouped_matmul resolves auto).
GROUPED_MATMUL = ("auto", "windowed", "ragged_dot")
# The per-layer statistics a MoE layer adds to the scan's carry, in this order.
STATS = ("load_balance", "z_loss", "dropped")
# Capacity buffers [X, B, C, D] where the tokens are, and where their experts are.
AT_TOKENS = (None, "batch", None, "embed")
AT_EXPERTS = ("experts", "batch", None, "embed")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoERun:
    """How a mixture of experts is run and trained (`moe.*` keys); not part of the weights."""

    dispatch: str = "dropless"
    grouped_matmul: str = "auto"
    capacity_factor: float = 1.25
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.001

    def check(self) -> None:
        if self.dispatch not in DISPATCH:
            raise UserError(f"moe.dispatch={self.dispatch!r} is not a dispatch mode; choose one of "
                            f"{', '.join(DISPATCH)} (docs/models.md, 'Mixtures of experts').")
        if self.grouped_matmul not in GROUPED_MATMUL:
            raise UserError(f"moe.grouped_matmul={self.grouped_matmul!r} is not a way to compute dropless's "
                            f"grouped matmuls; choose one of {', '.join(GROUPED_MATMUL)} (auto: the windows "
                            f"wherever they are measured to win or nothing is measured yet; docs/models.md, "
                            f"'Dispatch').")
        if not self.capacity_factor > 0:
            raise UserError(f"moe.capacity_factor={self.capacity_factor}: must be > 0 (1.0 gives each "
                            f"expert exactly its even share of a sequence's routed tokens; 1.25 is common).")
        for key in ("aux_loss_coef", "z_loss_coef"):
            if not getattr(self, key) >= 0:
                raise UserError(f"moe.{key}={getattr(self, key)}: must be >= 0 (0 turns the loss off).")


def capacity(seq_len: int, num_experts: int, k: int, factor: float) -> int:
    """Slots per expert and sequence: ceil(k T factor / X), at least 1."""
    return max(1, math.ceil(k * seq_len * factor / num_experts))


def route(x_btd: jax.Array, router_dx: jax.Array, k: int):
    """-> (expert ids [B, T, k] int32, weights [B, T, k] float32 summing to 1 per token,
    router logits [B, T, X] float32, probabilities [B, T, X] float32)."""
    logits = jnp.einsum("btd,dx->btx", x_btd, router_dx.astype(x_btd.dtype)).astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    top_p, top_i = jax.lax.top_k(probs, k)
    return top_i, top_p / top_p.sum(-1, keepdims=True), logits, probs


def aux_stats(top_i: jax.Array, logits: jax.Array, probs: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(load-balance loss, router z-loss), both [] float32, over every token of the batch."""
    x = probs.shape[-1]
    routed = jax.nn.one_hot(top_i, x, dtype=jnp.float32).sum(-2)   # [B, T, X] copies sent
    f = routed.mean((0, 1))                                          # [X], sums to k
    p = probs.mean((0, 1))                                           # [X], sums to 1
    z = jnp.square(jax.nn.logsumexp(logits, axis=-1)).mean()
    return x * jnp.sum(f * p), z


def capacity_masks(top_i: jax.Array, weights: jax.Array, num_experts: int, slots: int):
    """GShard's dispatch and combine tensors for groups of one sequence.

    top_i, weights [B, T, k] -> (dispatch [B, T, X, C] 0/1, combine [B, T, X, C] the
    routing weight in each kept slot, the copies dropped [] float32). Slots fill in
    priority order: every token's first choice, then every token's second, ...
    """
    b, t, k = top_i.shape
    onehot = jax.nn.one_hot(top_i, num_experts, dtype=jnp.int32)              # [B, T, k, X]
    by_choice = onehot.transpose(0, 2, 1, 3).reshape(b, k * t, num_experts)   # choice-major
    slot = (jnp.cumsum(by_choice, axis=1) - 1) * by_choice                    # slot in its expert
    slot = slot.reshape(b, k, t, num_experts).transpose(0, 2, 1, 3)           # [B, T, k, X]
    kept = onehot * (slot < slots)
    dropped = (onehot.sum() - kept.sum()).astype(jnp.float32)
    slot_1h = jax.nn.one_hot(jnp.where(kept > 0, slot, slots), slots, dtype=jnp.float32)  # [B, T, k, X, C]
    dispatch = slot_1h.sum(2)                                                  # choices hit distinct experts
    combine = jnp.einsum("btkxc,btk->btxc", slot_1h, weights)
    return dispatch, combine, dropped


def swiglu_experts(x_xbcd: jax.Array, w_gate, w_up, w_down, constrain: Hook) -> jax.Array:
    """Each expert's SwiGLU on its buffer: x [X, B, C, D] -> [X, B, C, D]."""
    dt = x_xbcd.dtype
    g = jnp.einsum("xbcd,xdf->xbcf", x_xbcd, w_gate.astype(dt))
    u = jnp.einsum("xbcd,xdf->xbcf", x_xbcd, w_up.astype(dt))
    h = constrain(jax.nn.silu(g) * u, ("experts", "batch", None, "mlp"))
    return jnp.einsum("xbcf,xfd->xbcd", h, w_down.astype(dt))


class MoE(nnx.Module):
    """The experts of a block (stacked with `stack` layers like every block weight)."""

    def __init__(self, *, embed: int, mlp: int, num_experts: int, k: int, shared: int, num_layers: int,
                 run: MoERun, param_dtype, rngs: nnx.Rngs, stack: int | None = None):
        d, f, x = embed, mlp, num_experts
        dt = jnp.dtype(param_dtype)
        std_out = 0.02 / math.sqrt(2 * num_layers)  # residual projections, as the dense MLP
        self.router = param(rngs, (d, x), ("embed", "experts"), stack, dt, "normal")
        self.w_gate = param(rngs, (x, d, f), ("experts", "embed", "mlp"), stack, dt, "normal")
        self.w_up = param(rngs, (x, d, f), ("experts", "embed", "mlp"), stack, dt, "normal")
        self.w_down = param(rngs, (x, f, d), ("experts", "mlp", "embed"), stack, dt, "normal", std_out)
        if shared:  # always-on experts (DeepSeekMoE, Dai et al. 2024): one SwiGLU of width shared x F
            self.shared_gate = param(rngs, (d, shared * f), ("embed", "mlp"), stack, dt, "normal")
            self.shared_up = param(rngs, (d, shared * f), ("embed", "mlp"), stack, dt, "normal")
            self.shared_down = param(rngs, (shared * f, d), ("mlp", "embed"), stack, dt, "normal", std_out)
        self.k, self.num_experts, self.shared, self.run = k, num_experts, shared, run

    def __call__(self, x_btd: jax.Array, constrain: Hook) -> tuple[jax.Array, jax.Array]:
        """x [B, T, D] -> (y [B, T, D], stats [3] float32: load balance, z-loss, dropped share)."""
        top_i, weights, logits, probs = route(x_btd, self.router[...], self.k)
        balance, z = aux_stats(top_i, logits, probs)
        if self.run.dispatch == "capacity":
            y, dropped = self._capacity(x_btd, top_i, weights, constrain)
        else:
            y = moe_dropless.experts(x_btd, top_i, weights, (self.w_gate[...], self.w_up[...], self.w_down[...]),
                                     constrain, self.run.grouped_matmul)
            dropped = jnp.zeros((), jnp.float32)
        if self.shared:
            dt = x_btd.dtype
            h = jax.nn.silu(x_btd @ self.shared_gate[...].astype(dt)) * (x_btd @ self.shared_up[...].astype(dt))
            y = y + constrain(h, ("batch", "length", "mlp")) @ self.shared_down[...].astype(dt)
        share = dropped / (top_i.size)
        return constrain(y, ("batch", "length", "embed")), jnp.stack([balance, z, share])

    def _capacity(self, x_btd, top_i, weights, constrain):
        """GShard dispatch: x [B, T, D] -> (y [B, T, D], copies dropped [])."""
        dt = x_btd.dtype
        slots = capacity(x_btd.shape[1], self.num_experts, self.k, self.run.capacity_factor)
        dispatch, combine, dropped = capacity_masks(top_i, weights, self.num_experts, slots)
        # Each buffer is made where its tokens are (experts whole, rows split as the batch),
        # then moved to its expert's devices: pinning both ends makes the move one
        # all-to-all, where GSPMD left to itself all-gathers the tokens instead.
        buffers = constrain(jnp.einsum("btxc,btd->xbcd", dispatch.astype(dt), x_btd), AT_TOKENS)
        buffers = constrain(buffers, AT_EXPERTS)
        out = swiglu_experts(buffers, self.w_gate[...], self.w_up[...], self.w_down[...], constrain)
        out = constrain(constrain(out, AT_EXPERTS), AT_TOKENS)
        return jnp.einsum("btxc,xbcd->btd", combine.astype(dt), out), dropped
