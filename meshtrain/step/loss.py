"""The training loss: mean next-token cross entropy, summed in float32, a chunk of positions at a time.

Taken whole, the loss holds the logits [B, T, V] and their gradient at once
(GPT-2 small at 16 x 1024 tokens: 1.6 GB each in bf16). With train.loss_chunk = c < T the model
stops before its output projection (`hidden`, models/family.py) and the loss computes its
value and its gradient together, one chunk of positions at a time:

    h [B, T, D] -> [n, B, c, D], targets [B, T] -> [n, B, c]       n = T / c
    total, dw = 0, zeros like w in float32
    for i in range(n):                                    # lax.scan
        logits = project(h[i], w)                         # [B, c, V] in the compute dtype
        total += sum over [B, c] of logsumexp(logits) - logits[targets[i]]   # float32 inside
        dlogits = softmax(logits) - onehot(targets[i])    # by hand, in the compute dtype
        dh[i], dw += dlogits pulled back through project  # d total / d h[i], d total / d w
    loss = total / (B T)

A custom VJP hands dh and dw, times the loss's cotangent, to autodiff. So at most one
chunk of logits and its gradient is alive, and nothing is recomputed: the matmuls
are the whole loss's (2 B T V D for the logits, 4 B T V D for the two gradients), run in
the forward pass. The primal alone (eval, no gradient) computes only the loss. This is
the fused linear cross entropy of Liger Kernel (Hsu et al. 2024, arXiv 2410.10989, §3.2),
in XLA ops. The logits are never written in float32 (`summed_cross_entropy`): under bf16
compute the matmul writes them in bf16, the max and the sum of exp read them, and one
element-wise pass writes the bf16 gradient, as llm.c's fused classifier kernel does; the
whole-logits loss (chunks = 1) takes the same function.

dw is summed over the chunks in float32, and each batch shard sums its own: the shards'
sums meet once, over the batch axes, in w's dtype (see `chunked_cross_entropy`), so the
gradient's data-parallel reduction sends what it sends without chunks.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from meshtrain.errors import UserError
from meshtrain.models import family
from meshtrain.parallel import sequence
from meshtrain.parallel.hook import Constrain
from meshtrain.parallel.layouts import Layout


def num_chunks(seq_len: int, loss_chunk: int) -> int:
    """How many pieces the loss cuts a sequence of `seq_len` positions into: 1 when
    loss_chunk is 0 or at least seq_len, else seq_len / loss_chunk (which must divide)."""
    if loss_chunk < 0:
        raise UserError(
            f"train.loss_chunk={loss_chunk}: must be >= 0, the positions in each chunk of the loss "
            f"(a divisor of model.seq_len={seq_len}), or 0 for the whole sequence at once.")
    if 0 < loss_chunk < seq_len and seq_len % loss_chunk:
        below = max(c for c in range(1, loss_chunk) if seq_len % c == 0)
        raise UserError(
            f"train.loss_chunk={loss_chunk} does not divide model.seq_len={seq_len}: the loss "
            f"projects the sequence in equal chunks of loss_chunk positions. Use a divisor of "
            f"{seq_len}, e.g. {below}, or 0 for the whole sequence at once.")
    return seq_len // loss_chunk if 0 < loss_chunk < seq_len else 1


def has_seam(module) -> bool:
    """Whether a model (class or instance) splits its forward into hidden and project."""
    return family.implements(module, family.HiddenProject)


def check_config(t, seq_len: int) -> None:
    """train.loss_chunk against the model's sequence length (see `num_chunks`)."""
    num_chunks(seq_len, t.loss_chunk)


BTD = ("batch", "length", "embed")


def check_split(loss_chunk: int, seq_len: int, layout: Layout, shape) -> None:
    """A chunk of the loss takes an equal share of rows from every piece of a split sequence
    (the residual stream's positions, split by context or sequence parallelism)."""
    q, chunks = layout.split(BTD, "length", shape)[0], num_chunks(seq_len, loss_chunk)
    c = seq_len // chunks
    if chunks > 1 and c % q:
        raise UserError(
            f"train.loss_chunk={c}: the layout splits each sequence's positions over {q} devices, "
            f"and each chunk of the loss takes an equal share from each, so loss_chunk must be a "
            f"multiple of {q} (and divide model.seq_len={seq_len}). Use e.g. {q * max(1, c // q)}, "
            f"or 0 for the whole sequence at once.")


@jax.custom_vjp
def summed_cross_entropy(logits_nv: jax.Array, targets_n: jax.Array, weights_n: jax.Array | None = None) -> jax.Array:
    """sum over n of weights[n] (logsumexp(logits[n]) - logits[n, targets[n]]), in float32,
    for logits [..., V] in their own dtype (bf16 under bf16 compute), integer targets
    [...] and float32 weights [...] (None: all 1; a packed window's documents give 0 to
    the target across a boundary, models/documents.py).

    Float32 exists only inside the reductions and the gradient's element-wise pass, which
    read the logits in their dtype: nothing [..., V] is written in float32. The gradient,
    softmax(logits) - onehot(targets), is written by hand (as llm.c's fused classifier
    does) and comes out in the logits' dtype, as autodiff of a float32 upcast gave it."""
    return _summed_forward(logits_nv, targets_n, weights_n)[0]


def _summed_forward(logits_nv, targets_n, weights_n=None):
    z = logits_nv.astype(jnp.float32)
    m_n = jax.lax.stop_gradient(z.max(axis=-1))
    lse_n = m_n + jnp.log(jnp.exp(z - m_n[..., None]).sum(axis=-1))
    picked_n = jnp.take_along_axis(logits_nv, targets_n[..., None], axis=-1)[..., 0].astype(jnp.float32)
    each_n = lse_n - picked_n
    total = each_n.sum() if weights_n is None else (weights_n * each_n).sum()
    return total, (logits_nv, targets_n, weights_n, lse_n)


def _summed_backward(residuals, g):
    logits_nv, targets_n, weights_n, lse_n = residuals
    p_nv = jnp.exp(logits_nv.astype(jnp.float32) - lse_n[..., None])
    hit = jax.lax.broadcasted_iota(targets_n.dtype, logits_nv.shape, logits_nv.ndim - 1) == targets_n[..., None]
    g_n = g if weights_n is None else (g * weights_n)[..., None]
    return (g_n * jnp.where(hit, p_nv - 1.0, p_nv)).astype(logits_nv.dtype), None, None


summed_cross_entropy.defvjp(_summed_forward, _summed_backward)


def cross_entropy(logits_btv: jax.Array, targets_bt: jax.Array, weights_bt: jax.Array | None = None) -> jax.Array:
    """Next-token loss in float32 over whole logits [B, T, V] (`summed_cross_entropy`),
    divided by the B T positions (with weights too: see tasks/language.py's `loss`)."""
    return summed_cross_entropy(logits_btv, targets_bt, weights_bt) / targets_bt.size


def chunked_cross_entropy(project: Callable, h_btd: jax.Array, w: jax.Array, targets_bt: jax.Array,
                          chunks: int, layout: Layout, mesh: Mesh, weights_bt: jax.Array | None = None) -> jax.Array:
    """`cross_entropy(project(h, w), targets, weights)` over `chunks` equal pieces of the
    length, with its gradient computed alongside (module docstring). h [B, T, D], targets
    and weights [B, T] (weights None: all 1).

    project(h [b, c, D], w, constrain) -> logits [b, c, V] in w's dtype, for the b rows of
    one batch shard; it must read nothing but its arguments (a custom VJP cannot pass a
    gradient to values it closes over). The n batch shards each run the chunks on their own
    copy of w, so w's gradient adds up on each device and is reduced over the batch axes
    once, when autodiff transposes the copy (as meshtrain/parallel/pipeline/scan.py copies the stage
    weights): summed in the scan, it would be all-reduced once per chunk. Under context
    parallelism the positions stay split too, and each (batch shard, piece of the positions)
    pair has its copy. A chunk sees the layout without those axes; the vmap puts them back.
    """
    b, t, d = h_btd.shape
    c = t // chunks  # a multiple of the stream's pieces q: experiment.validate checks it (check_split)
    # A shard is a batch shard and, under context parallelism, a piece of the positions
    # (attention's length split): the positions stay split through the loss, so each piece
    # sums its own gradient of w too. Sequence parallelism's pieces (length:tensor in the
    # stream alone) are gathered for the vocab-split projection as in the model.
    nb, batch_axes = layout.shards("batch", mesh.shape)
    nc, context_axes = sequence.split(layout, mesh.shape)
    n, axes = nb * nc, (*batch_axes, *context_axes)
    inner = layout.without(*axes)
    shard, inner_constrain = axes or None, Constrain(inner, mesh)
    # The stream's positions are in q pieces (nc context pieces of qt each): each chunk takes
    # c/q rows from every piece, so no chunk moves a row between devices. The loss is a sum
    # over positions, so which rows make up a chunk does not change it.
    q = layout.split(BTD, "length", mesh.shape)[0]
    qt = q // nc
    # [B, T, ...] -> [chunks, nb x nc, B/nb, c/nc, ...]: shard (k, j) keeps batch shard k's
    # rows and context piece j's positions; chunk i holds rows i*c/q .. (i+1)*c/q - 1 of
    # each of the q pieces of each row.
    def per_chunk(a, axes):
        rest = a.shape[2:]
        a = (a.reshape(nb, b // nb, nc, qt, chunks, c // q, *rest).transpose(4, 0, 2, 1, 3, 5, *range(6, 6 + len(rest)))
             .reshape(chunks, n, b // nb, c // nc, *rest))
        where = NamedSharding(mesh, P(None, shard, *inner.spec(axes, "activations")))
        return jax.lax.with_sharding_constraint(a, where)
    h, y = per_chunk(h_btd, BTD), per_chunk(targets_bt, BTD[:2])
    wts = None if weights_bt is None else per_chunk(weights_bt, BTD[:2])
    # One copy of w per shard: each shard sums its gradient over the chunks, and autodiff's
    # transpose of the copy reduces the shards' sums over the batch (and context) axes once,
    # in w's dtype, as narrow as without chunks.
    per_shard = NamedSharding(mesh, P(shard, *(P.UNCONSTRAINED,) * w.ndim))
    copies = jax.lax.with_sharding_constraint(jnp.broadcast_to(w[None], (n, *w.shape)), per_shard)

    def zeros_n():  # [n] float32, a sum per batch shard
        return jax.lax.with_sharding_constraint(jnp.zeros((n,), jnp.float32), NamedSharding(mesh, P(shard)))

    def shard_loss(w, h_bcd, y_bc, w_bc):  # one shard, one chunk: h [B/nb, c/nc, D] -> summed loss
        return summed_cross_entropy(project(h_bcd, w, inner_constrain), y_bc, w_bc)

    def shard_grads(w, h_bcd, y_bc, w_bc):  # -> (summed loss, its gradient for w in float32, for h)
        loss, (dw, dh) = jax.value_and_grad(shard_loss, argnums=(0, 1))(w, h_bcd, y_bc, w_bc)
        return loss, dw.astype(jnp.float32), dh

    @jax.custom_vjp
    def summed(copies, h, y, wts):  # -> [n] each shard's summed loss
        def body(total_n, hy):
            return total_n + jax.vmap(shard_loss, spmd_axis_name=shard)(copies, *hy), None
        return jax.lax.scan(body, zeros_n(), (h, y, wts))[0]

    def summed_fwd(copies, h, y, wts):
        def body(carry, hy):
            total_n, dw_n = carry
            loss_n, dw, dh = jax.vmap(shard_grads, spmd_axis_name=shard)(copies, *hy)
            return (total_n + loss_n, dw_n + dw), dh
        dw0 = jax.lax.with_sharding_constraint(jnp.zeros(copies.shape, jnp.float32), per_shard)
        (total_n, dw_n), dh = jax.lax.scan(body, (zeros_n(), dw0), (h, y, wts))
        return total_n, (dw_n, dh)

    def summed_bwd(residuals, g_n):  # g_n [n]: the cotangent of each shard's sum
        dw_n, dh = residuals
        dw = (g_n.reshape(n, *(1,) * w.ndim) * dw_n).astype(w.dtype)
        return dw, (g_n.reshape(1, n, 1, 1, 1) * dh).astype(dh.dtype), None, None

    summed.defvjp(summed_fwd, summed_bwd)
    return summed(copies, h, y, wts).sum() / (b * t)


def head_loss(module, h_btd: jax.Array, w: jax.Array, targets_bt: jax.Array, weights_bt: jax.Array | None,
              constrain: Constrain, layout: Layout, mesh: Mesh, *, loss_chunk: int) -> jax.Array:
    """The mean loss after the last block: a bound model's `project` of h [B, T, D] (storage
    order) against targets [B, T], whole or loss_chunk positions at a time. The 1F1B
    schedule runs it on every stage (parallel/pipeline/schedule_1f1b.py)."""
    chunks = num_chunks(h_btd.shape[1], loss_chunk)
    if chunks == 1:
        return cross_entropy(module.project(h_btd, w, constrain), targets_bt, weights_bt)
    return chunked_cross_entropy(module.project, h_btd, w, targets_bt, chunks, layout, mesh, weights_bt)
