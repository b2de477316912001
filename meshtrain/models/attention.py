"""Causal dot-product attention, with or without a KV cache (shared by the models), and
the choice of kernel behind it (`model.attention`).

Shapes: B batch, T query positions, S cache positions, H query heads, K key/value
heads (K divides H: grouped-query attention when K < H), E head width.

Implementations, all computing softmax(q k^T / sqrt(E) + causal mask) v:

  xla     plain XLA ops (`causal_attention`, the math of jax.nn.dot_product_attention's
          XLA path): materialises the [B, H, T, T] scores and keeps the probabilities,
          only them, for backward unless remat recomputes them
  cudnn   cuDNN's fused flash attention (jax.nn.dot_product_attention, implementation
          "cudnn"): never materialises [T, T]; needs an NVIDIA GPU of compute capability
          >= 8.0, bf16 or fp16, and a head width that is a multiple of 8 up to 128
          (256 from compute capability 9.0). JAX partitions it over batch and heads.
  auto    cudnn where it applies, else xla.

`pallas` (JAX's Pallas/Triton flash-attention kernel) is refused with a UserError: JAX 0.11
deprecates jax.experimental.pallas.ops.gpu.attention, and its tests failed on JAX 0.11.2.

Decoding with a KV cache always uses xla: its mask is the cache's fill level, not the
causal square these kernels are given. A layout that splits attention's positions over
devices (context parallelism) runs parallel/context_attention.py instead, in XLA blocks: the
kernels return no log-sum-exp to merge a device's blocks with.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from meshtrain.errors import UserError
from meshtrain.models import documents
from meshtrain.models.hook import UNSHARDED, Hook

Cache = tuple[jax.Array, jax.Array]  # (k [B, S, K, E], v [B, S, K, E])
IMPLEMENTATIONS = ("auto", "xla", "cudnn")


@dataclasses.dataclass(frozen=True)
class Platform:
    """What the choice depends on besides the model: the backend ("cpu", "gpu", "tpu"),
    the GPU's compute capability ("9.0") and whether cuDNN is loaded."""

    name: str
    compute_capability: str | None = None
    cudnn: bool = False

    @classmethod
    def current(cls) -> "Platform":
        device = jax.devices()[0]
        if device.platform != "gpu":
            return cls(device.platform)
        try:
            from jax._src.lib import cuda_versions  # absent on ROCm builds
            cudnn = cuda_versions is not None and cuda_versions.cudnn_get_version() > 0
        except ImportError:
            cudnn = False
        return cls("gpu", getattr(device, "compute_capability", None), cudnn)


def _cudnn_refusal(platform: Platform, dtype: str, head_dim: int) -> str | None:
    """Why cuDNN flash attention cannot run here, or None when it can."""
    if platform.name != "gpu":
        return f"cuDNN flash attention needs an NVIDIA GPU; this backend is {platform.name}"
    if not platform.cudnn:
        return "cuDNN is not loaded (ROCm, or a CUDA install without cuDNN)"
    capability = tuple(int(x) for x in (platform.compute_capability or "0.0").split("."))
    if capability < (8, 0):
        return f"compute capability {platform.compute_capability} is below 8.0 (Ampere)"
    if dtype not in ("bfloat16", "float16"):
        return f"model.dtype={dtype}: cuDNN flash attention runs in bfloat16 or float16"
    widest = 256 if capability >= (9, 0) else 128
    if head_dim % 8 or head_dim > widest:
        return f"head width {head_dim}: cuDNN needs a multiple of 8 up to {widest}"
    return None


def choose(requested: str, *, platform: Platform, dtype: str, head_dim: int) -> tuple[str, str]:
    """-> (implementation, why): what `model.attention=requested` runs as, and the reason
    in words for the start-up log. An explicit choice that cannot run is a UserError."""
    if requested == "pallas":
        raise UserError("model.attention=pallas: the Pallas (Triton) flash-attention kernel was "
                        "removed, because JAX 0.11 deprecates jax.experimental.pallas.ops.gpu."
                        "attention. Use model.attention=cudnn on GPUs (model.attention=auto "
                        "already picks it where it applies) or model.attention=xla.")
    if requested not in IMPLEMENTATIONS:
        raise UserError(f"model.attention={requested!r} is not an attention implementation. "
                        f"Choose one of: {', '.join(IMPLEMENTATIONS)} (docs/performance.md).")
    cudnn_no = _cudnn_refusal(platform, dtype, head_dim)
    if requested == "auto":
        if cudnn_no is None:
            return "cudnn", "auto: cuDNN flash attention applies (GPU, 16-bit, head width fits)"
        return "xla", f"auto: XLA attention, since {cudnn_no}"
    if requested == "cudnn" and cudnn_no is not None:
        raise UserError(f"model.attention=cudnn cannot run: {cudnn_no}. Use model.attention=auto "
                        f"(cuDNN where it applies, else XLA) or model.attention=xla.")
    return requested, "as asked"


# What masked scores are set to: jax.nn.dot_product_attention's value for float32 scores.
CONTEXT_KINDS = ("allgather", "ring")  # model.context_attention: how a split sequence's pieces meet
BTHE = ("batch", "length", "heads", "head_dim")
BTKE = ("batch", "length", "kv_heads", "head_dim")
_MASKED = float(-0.7 * np.finfo(np.float32).max)


@jax.custom_jvp
def causal_softmax(scores_ts: jax.Array) -> jax.Array:
    """softmax over the last axis of float32 scores [..., T, S] with position t seeing
    s <= t: the scores past t set to -0.7 x the float32 maximum, then exp(x - max) / sum,
    as jax.nn.dot_product_attention's XLA path computes it.

    The derivative is written out, y * (dx - sum(y dx)), so the backward pass keeps y and
    nothing else. Autodiff of jnp.where + jax.nn.softmax (JAX's default,
    `jax_softmax_custom_jvp` off) keeps the exponentials, their sum, the quotient, the mask
    and the masked scores, each [B, H, T, S], and runs a longer chain over them: on the
    CPU 4 x 128 GPT-2 that cost a fifth of the step (docs/benchmarks.md, "CPU step"). The
    masked entries' y is exactly 0, so their gradient is 0, as the select's would be."""
    t, s = scores_ts.shape[-2:]
    x = jnp.where(jnp.tril(jnp.ones((t, s), bool)), scores_ts, jnp.float32(_MASKED))
    unnormalized = jnp.exp(x - jnp.max(x, -1, keepdims=True))
    return unnormalized / jnp.sum(unnormalized, -1, keepdims=True)


@causal_softmax.defjvp
def _causal_softmax_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    y = causal_softmax(x)
    return y, y * (dx - jnp.sum(y * dx, -1, keepdims=True))


def causal_attention(q_bthe: jax.Array, k_bske: jax.Array, v_bske: jax.Array,
                     segments_bt: jax.Array | None = None) -> jax.Array:
    """softmax(q k^T / sqrt(E), causal) v: [B, T, H, E] from q [B, T, H, E], k and v
    [B, S, K, E] (S = T; grouped-query when K < H: query head h reads key head h // (H/K)).
    With `segments` [B, T] (a packed window's documents, models/documents.py) a query sees
    only the keys of its own document too.

    The arithmetic of jax.nn.dot_product_attention(is_causal=True)'s XLA path: scores in
    float32 whatever the input dtype, scaled after the product, masked and normalised by
    `causal_softmax`, probabilities cast to v's dtype. What differs is the cost only: the
    [T, S] mask is not materialised per batch row and head, and the backward pass keeps
    the probabilities alone."""
    b, t, h, e = q_bthe.shape
    k = k_bske.shape[2]
    q = q_bthe.reshape(b, t, k, h // k, e)
    scores = jnp.einsum("btkge,bske->bkgts", q, k_bske, preferred_element_type=jnp.float32)
    scores = scores * jnp.float32(1.0 / np.sqrt(e))  # as jax.nn.dot_product_attention rounds it
    if segments_bt is not None:  # masked to the same value, so causal_softmax zeroes them alike
        same = documents.same_segment(segments_bt, segments_bt)[:, :, None]  # [B, 1, 1, T, S]
        scores = jnp.where(same, scores, jnp.float32(_MASKED))
    probs = causal_softmax(scores).astype(v_bske.dtype)
    return jnp.einsum("bkgts,bske->btkge", probs, v_bske).reshape(b, t, h, e)


def check_context_kind(kind: str) -> None:
    if kind not in CONTEXT_KINDS:
        raise UserError(f"model.context_attention={kind!r} is not a way to attend across a split "
                        f"sequence. Choose one of: {', '.join(CONTEXT_KINDS)} (docs/layouts.md, "
                        f"'Long sequences').")


def _query_heads(kv_btke: jax.Array, heads: int, constrain: Hook) -> jax.Array:
    """[B, T, K, E] -> [B, T, H, E]: query head h reads kv head h // (H/K). jnp.repeat keeps
    each group contiguous, so a tensor rank holding a block of query heads needs only its
    rows of the K heads it was given whole."""
    group = heads // kv_btke.shape[2]
    out = jnp.repeat(kv_btke, group, axis=2)
    return constrain(out, BTHE)


def attend(q_bthe: jax.Array, k_btke: jax.Array, v_btke: jax.Array,
           cache: Cache | None = None, pos: jax.Array | None = None, *,
           implementation: str = "xla", constrain: Hook = UNSHARDED,
           context: str = "allgather") -> tuple[jax.Array, Cache | None]:
    """-> (out [B, T, H, E], cache).

    Without a cache, position i attends to positions <= i of this call (of its own
    document when `constrain.documents` says the window is packed so), with the chosen
    `implementation` (already resolved by `choose`: xla or cudnn), k and v repeated
    to the H query heads first when K < H. When the layout splits the positions over
    devices, the rows are in its zigzag order (parallel/sequence.py), `context`
    (model.context_attention: allgather or ring) says how the pieces meet, and only the K
    heads travel (parallel/context_attention.py). With a cache, k and v are written at cache
    positions pos..pos+T-1 and query i (at position pos + i) attends to cache positions
    <= pos + i; the rest of the cache is masked, and dot_product_attention groups the H
    query heads over the K cached ones itself.
    """
    if cache is None:
        if constrain.splits_length:
            return constrain.attend_split(q_bthe, k_btke, v_btke, context), None
        if k_btke.shape[2] < q_bthe.shape[2]:
            k_btke, v_btke = (_query_heads(a, q_bthe.shape[2], constrain) for a in (k_btke, v_btke))
        docs = constrain.documents
        segments_bt = None if docs is None else docs.segments
        if implementation == "xla":
            return causal_attention(q_bthe, k_btke, v_btke, segments_bt), None
        mask = None if docs is None else documents.same_segment(segments_bt, segments_bt)
        return jax.nn.dot_product_attention(q_bthe, k_btke, v_btke, mask=mask, is_causal=True,
                                            implementation=implementation), None
    ck, cv = cache
    ck = jax.lax.dynamic_update_slice_in_dim(ck, k_btke.astype(ck.dtype), pos, axis=1)
    cv = jax.lax.dynamic_update_slice_in_dim(cv, v_btke.astype(cv.dtype), pos, axis=1)
    t, s = q_bthe.shape[1], ck.shape[1]
    mask_ts = jnp.arange(s)[None, :] <= pos + jnp.arange(t)[:, None]
    out = jax.nn.dot_product_attention(q_bthe, ck.astype(q_bthe.dtype), cv.astype(q_bthe.dtype),
                                       mask=mask_ts[None, None])
    return out, (ck, cv)
