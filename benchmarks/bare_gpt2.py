"""The one bare-JAX GPT-2 train step that benchmarks/overhead.py and benchmarks/step_cpu.py
time meshtrain against: forward, loss and update written in jax.numpy over the params dict
meshtrain stores. It imports jax alone (no flax, optax or meshtrain), so step_cpu.py
--peer levanter can run it in a peer framework's environment; what is meshtrain's comes in
through the parameters of `make_step`.

Params (L stacked layers, D embed, H heads, E = D / H, F mlp, V vocab rows, padding
included, T positions):
    wte [V, D], wpe [T, D], ln_f {scale [D], bias [D]},
    blocks {ln1, ln2: {scale [L, D], bias [L, D]},
            attn: {w_qkv [L, D, 3, H, E], b_qkv [L, 3, H, E], w_out [L, H, E, D], b_out [L, D]},
            mlp: {w_fc [L, D, F], b_fc [L, F], w_proj [L, F, D], b_proj [L, D]}}
The step: state (n [] int32, params, opt_state), tokens [B, T+1] int32 -> (state,
{"loss": [], "grad_norm": [], "lr": []} or those asked for), jitted with the caller's shardings, the state
donated. Pre-LayerNorm blocks under lax.scan, the embedding tied to the output projection,
the mean next-token loss, the global gradient norm of the (pinned) gradients.

What a caller plugs in (step_cpu.py takes the defaults; overhead.py passes meshtrain's):
- `Kernels`: layer_norm, gelu, attend, loss. Defaults: a plain LayerNorm, jax.nn.gelu
  (approximate=True, GPT-2's gelu_new), jax.nn.dot_product_attention(is_causal=True), cross
  entropy from jax.nn.log_softmax over whole logits.
- `pin(x, axes)`: a sharding constraint on an array given its logical axes (BTD, ...);
  the default pins nothing.
- `Optimizer(update, schedule)`: `adamw` here is AdamW by hand.
- dtype (the compute dtype matrices are cast to), vocab_size (rows of wte past it are
  padding, masked out of the logits), param_shardings (where the cast matrices are pinned),
  grad_shardings (where the gradients are pinned).
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

# The logical axes each pinned array is handed to `pin` with (meshtrain's names).
BTD = ("batch", "length", "embed")
BTHE = ("batch", "length", "heads", "head_dim")
BTF = ("batch", "length", "mlp")
BTV = ("batch", "length", "vocab")
VD = ("vocab", "embed")


def no_pin(x, axes):
    return x


def stacked(path) -> int:
    """1 for a leaf of params["blocks"] (its first dim is the layer), else 0."""
    return int(path[0].key == "blocks")


# ---- the default kernels: jax.numpy and jax.nn as a JAX user would first write them ----

def plain_layer_norm(x, scale, bias):  # x [..., D], scale and bias [D] -> [..., D]
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * scale + bias


def tanh_gelu(h):  # GPT-2's gelu_new
    return jax.nn.gelu(h, approximate=True)


def causal_attention(q, k, v):  # [B, T, H, E] x3 -> [B, T, H, E]; position i sees <= i
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def log_softmax_loss(project, h, w, targets, pin):
    """Mean cross entropy over whole logits project(h [B, T, D], w [V, D], pin) [B, T, V]
    against targets [B, T] -> []."""
    logp = jax.nn.log_softmax(project(h, w, pin), axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()


class Kernels(NamedTuple):
    """The numeric pieces of the step. overhead.py passes meshtrain's, which compute the same
    math in their own formulation (a LayerNorm and GELU that backward recomputes, a fused
    loss), so that what it compares is the framework around them, not the formulation."""
    layer_norm: Callable = plain_layer_norm  # (x [..., D], scale [D], bias [D]) -> [..., D]
    gelu: Callable = tanh_gelu               # [..., F] -> [..., F]
    attend: Callable = causal_attention      # (q, k, v [B, T, H, E]) -> [B, T, H, E]
    # (project, h [B, T, D], w [V, D], targets [B, T], pin) -> mean loss []; project(h, w,
    # constrain) -> logits [b, c, V] reads nothing but its arguments, so a kernel may run it
    # on pieces of h under a custom VJP (meshtrain's chunked loss does).
    loss: Callable = log_softmax_loss


class Optimizer(NamedTuple):
    update: Callable    # (grads, opt_state, params, n [], grad_norm []) -> (params, opt_state)
    schedule: Callable  # n [] -> the learning rate of step n []


# ---- AdamW by hand ------------------------------------------------------------------------

def adamw(lr: float, min_lr: float, warmup: int, steps: int, b1: float, b2: float, eps: float,
          weight_decay: float, clip: float) -> Optimizer:
    """AdamW over opt_state (mu, nu), each shaped like params (`adamw_init`): gradients
    clipped to global norm `clip`; the learning rate linear from 0 to `lr` over `warmup`
    steps, then a cosine down to `min_lr` at `steps`; weight decay on matrices and
    embeddings only (what has two dims or more besides the layer's)."""
    def schedule(n):
        warm = lr * n / warmup
        frac = jnp.clip((n - warmup) / (steps - warmup), 0.0, 1.0)
        return jnp.where(n < warmup, warm, min_lr + (lr - min_lr) * 0.5 * (1 + jnp.cos(jnp.pi * frac)))

    def update(grads, opt_state, params, n, grad_norm):
        grads = jax.tree.map(lambda g: g * jnp.minimum(1.0, clip / grad_norm), grads)
        mu, nu = opt_state
        mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, mu, grads)
        nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * jnp.square(g), nu, grads)
        c1, c2, rate = 1 - b1 ** (n + 1.0), 1 - b2 ** (n + 1.0), schedule(n)

        def one(path, p, m, v):
            u = (m / c1) / (jnp.sqrt(v / c2) + eps)
            return p - rate * (u + weight_decay * p if p.ndim - stacked(path) >= 2 else u)
        return jax.tree_util.tree_map_with_path(one, params, mu, nu), (mu, nu)

    return Optimizer(update, schedule)


def adamw_init(params):
    """(mu, nu) zeros like params, two buffers each: the step donates its state."""
    zeros = jax.tree.map(jnp.zeros_like, params)
    return zeros, jax.tree.map(jnp.copy, zeros)


def init(key, *, layers: int, embed: int, heads: int, mlp: int, vocab: int, seq_len: int) -> dict:
    """Params in meshtrain's tree and shapes (module docstring), so meshtrain's can be fed
    in instead; GPT-2's initialisation: normal(0.02), wpe normal(0.01), the residual
    projections' std / sqrt(2 L), biases zero, LayerNorm scales one."""
    L, D, H, F, V, T = layers, embed, heads, mlp, vocab, seq_len
    ks = iter(jax.random.split(key, 8))
    n = lambda shape, std=0.02: std * jax.random.normal(next(ks), shape, jnp.float32)  # noqa: E731
    ones, zeros, e, res = jnp.ones, jnp.zeros, D // H, 0.02 / math.sqrt(2 * L)
    return {"wte": n((V, D)), "wpe": n((T, D), 0.01), "ln_f": {"scale": ones(D), "bias": zeros(D)},
            "blocks": {"ln1": {"scale": ones((L, D)), "bias": zeros((L, D))},
                       "ln2": {"scale": ones((L, D)), "bias": zeros((L, D))},
                       "attn": {"w_qkv": n((L, D, 3, H, e)), "b_qkv": zeros((L, 3, H, e)),
                                "w_out": n((L, H, e, D), res), "b_out": zeros((L, D))},
                       "mlp": {"w_fc": n((L, D, F)), "b_fc": zeros((L, F)),
                               "w_proj": n((L, F, D), res), "b_proj": zeros((L, D))}}}


# ---- the step -----------------------------------------------------------------------------

def make_step(optimizer: Optimizer, state_shardings, batch_sharding: NamedSharding, *,
              kernels: Kernels = Kernels(), pin: Callable = no_pin, dtype=jnp.float32,
              vocab_size: int | None = None, param_shardings=None, grad_shardings=None,
              metrics: tuple[str, ...] = ("loss", "grad_norm", "lr")):
    """-> jitted step((n, params, opt_state), tokens [B, T+1]) -> (state, metrics) (module
    docstring); state_shardings (n's, params', opt_state's) are its input and output
    shardings, the metrics come out replicated. `metrics` names the ones returned: an
    output is a value XLA must materialise (the learning rate once, instead of inside each
    leaf's update), so a caller timing the step asks for what it reads."""
    dt = jnp.dtype(dtype)

    def project(h, w, constrain):  # h [b, c, D], w [V, D] -> logits [b, c, V], padding masked
        logits = jnp.einsum("btd,vd->btv", h, w)
        if vocab_size is not None and w.shape[0] > vocab_size:
            real = jnp.arange(w.shape[0]) < vocab_size
            logits = jnp.where(real, logits, jnp.finfo(dt).min)
        return constrain(logits, BTV)

    def layer_norm(x, p):
        return kernels.layer_norm(x, p["scale"], p["bias"])

    def block(x, p):  # x [B, T, D]; p: one layer's slice of params["blocks"]
        a, m = p["attn"], p["mlp"]
        h = layer_norm(x, p["ln1"])
        qkv = jnp.einsum("btd,dkhe->btkhe", h, a["w_qkv"].astype(dt)) + a["b_qkv"].astype(dt)  # [B,T,3,H,E]
        q, k, v = (pin(qkv[:, :, i], BTHE) for i in range(3))                                # [B,T,H,E]
        o = pin(kernels.attend(q, k, v), BTHE)                                               # [B,T,H,E]
        # The bias joins its projection before the residual add, as in gpt2.py's sublayers:
        # float addition is not associative, and overhead.py checks bitwise agreement.
        x = pin(x + (jnp.einsum("bthe,hed->btd", o, a["w_out"].astype(dt)) + a["b_out"].astype(dt)), BTD)
        h = layer_norm(x, p["ln2"])
        f = pin(kernels.gelu(h @ m["w_fc"].astype(dt) + m["b_fc"].astype(dt)), BTF)        # [B,T,F]
        x = pin(x + (f @ m["w_proj"].astype(dt) + m["b_proj"].astype(dt)), BTD)
        return x, None

    def cast_matrices(params):  # every matrix to the compute dtype once, pinned as stored
        def one(path, p, sharding=None):
            if p.ndim - stacked(path) < 2 or p.dtype == dt:
                return p
            p = p.astype(dt)
            return p if sharding is None else jax.lax.with_sharding_constraint(p, sharding)
        if param_shardings is None:
            return jax.tree_util.tree_map_with_path(one, params)
        return jax.tree_util.tree_map_with_path(one, params, param_shardings)

    def loss_fn(params, tokens):  # tokens [B, T+1] int32 -> mean next-token loss []
        params = cast_matrices(params)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]                        # [B, T]
        wte = pin(params["wte"], VD)                                           # [V, D]
        x = jnp.take(wte, inputs, axis=0) + params["wpe"][:inputs.shape[1]]   # [B, T, D]
        x = pin(x.astype(dt), BTD)
        x, _ = jax.lax.scan(block, x, params["blocks"])                        # over L stacked layers
        x = layer_norm(x, params["ln_f"])
        return kernels.loss(project, x, wte, targets, pin)                     # tied embedding

    def step(state, tokens):
        n, params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        if grad_shardings is not None:
            grads = jax.lax.with_sharding_constraint(grads, grad_shardings)
        grad_norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))
        params, opt_state = optimizer.update(grads, opt_state, params, n, grad_norm)
        out = {"loss": loss, "grad_norm": grad_norm, "lr": optimizer.schedule(n)}
        return (n + 1, params, opt_state), {k: out[k] for k in metrics}

    replicated = NamedSharding(batch_sharding.mesh, P())
    return jax.jit(step, in_shardings=(state_shardings, batch_sharding),
                   out_shardings=(state_shardings, replicated), donate_argnums=(0,))
