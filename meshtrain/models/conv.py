"""The layers the image families share (models/vgg.py, models/resnet.py), written with
logical axis names only, as the transformer layers are (models/gpt2.py).

Activations are NHWC: [B, H, W, C] with logical axes ("batch", "height", "width", c),
c one of "image_channels" (the input's colours), "channels" (feature maps tensor
parallelism keeps whole) or "filters" (feature maps it splits: the output of the first
conv of a channel-parallel pair, the input of the second, as `mlp` in a transformer's MLP).
A kernel is [kh, kw, in, out] with axes ("kernel_h", "kernel_w", in, out).

Every nnx.Param and nnx.BatchStat carries its logical axes as `out_sharding` metadata;
meshtrain.step.state reads them, as for the language models.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from meshtrain.errors import UserError
from meshtrain.models.hook import UNSHARDED, Hook

# PyTorch's BatchNorm defaults (torchvision builds VGG-bn and ResNet with them): the running
# statistics keep 0.9 of their value per step (PyTorch writes momentum=0.1 for the new part).
BN_MOMENTUM = 0.9
BN_EPSILON = 1e-5


class ConvSpec(NamedTuple):
    """One conv of a model, as the families' `convs(cfg)` list them (for parameter and
    multiply-add counts, and for what a spatial split exchanges: k//2 rows of the input,
    h_in wide, c_in deep, each way at each boundary)."""

    name: str
    k: int
    c_in: int
    c_out: int
    stride: int
    h_in: int     # input height = width
    h_out: int    # ceil(h_in / stride)
    axes: tuple[str, str]  # logical (in, out) feature names

    @property
    def params(self) -> int:
        """Kernel weights, no bias."""
        return self.k * self.k * self.c_in * self.c_out

    @property
    def macs(self) -> int:
        """Multiply-adds per image."""
        return self.h_out * self.h_out * self.params


def _variable(kind, value: jax.Array, axes: tuple[str, ...]):
    # Sharding is applied by meshtrain.step.state from these names, not eagerly by Flax.
    return kind(value, out_sharding=axes, eager_sharding=False)


def conv_output_size(size: int, stride: int) -> int:
    """Rows out of a conv with k//2 padding each side, odd k: ceil(size / stride)."""
    return -(-size // stride)


class Conv(nnx.Module):
    """A k x k conv, stride `stride`, k//2 zero rows and columns padded on each side (the
    output is ceil(H / stride) x ceil(W / stride), as 'SAME' gives, but padded
    symmetrically as torchvision's convs are, so a strided conv samples the same pixels
    and each split boundary of a spatial layout needs k//2 halo rows each way).

    kernel [k, k, in, out] ("kernel_h", "kernel_w", axes[0], axes[1]), initialised
    He-normal over fan-out (torchvision's VGG and ResNet); bias [out] (axes[1]), zeros.
    """

    def __init__(self, rngs: nnx.Rngs, k: int, c_in: int, c_out: int, axes: tuple[str, str], *,
                 stride: int = 1, bias: bool = False, param_dtype="float32"):
        dt = jnp.dtype(param_dtype)
        std = math.sqrt(2.0 / (k * k * c_out))
        self.kernel = _variable(nnx.Param, std * jax.random.normal(rngs.params(), (k, k, c_in, c_out), dt),
                                ("kernel_h", "kernel_w", *axes))
        self.bias = _variable(nnx.Param, jnp.zeros((c_out,), dt), (axes[1],)) if bias else None
        self.k, self.stride = k, stride

    def __call__(self, x_bhwc: jax.Array) -> jax.Array:
        """x [B, H, W, in] -> [B, ceil(H/s), ceil(W/s), out] in x's dtype."""
        dt = x_bhwc.dtype
        p = self.k // 2
        y = jax.lax.conv_general_dilated(
            x_bhwc, self.kernel[...].astype(dt), window_strides=(self.stride, self.stride),
            padding=((p, p), (p, p)), dimension_numbers=("NHWC", "HWIO", "NHWC"))
        if self.bias is not None:
            y = y + self.bias[...].astype(dt)
        return y


class BatchNorm(nnx.Module):
    """Batch normalisation over (batch, height, width) per feature map (Ioffe and Szegedy
    2015), PyTorch's conventions: epsilon 1e-5, running statistics updated as
    running = 0.9 running + 0.1 batch, the running variance from the unbiased batch
    variance, normalisation with the biased one. Statistics in float32 whatever the
    compute dtype.

    scale, bias: nnx.Param [C]; mean, var: nnx.BatchStat [C]; all with axes (`axis`,).
    Under a layout that splits batch or height, the mean over those dims of the global
    array is one all-reduce GSPMD inserts: the statistics are the whole batch's on every
    device (synchronised BatchNorm), so a layout does not change the result.
    """

    def __init__(self, c: int, axis: str, param_dtype="float32"):
        dt = jnp.dtype(param_dtype)
        self.scale = _variable(nnx.Param, jnp.ones((c,), dt), (axis,))
        self.bias = _variable(nnx.Param, jnp.zeros((c,), dt), (axis,))
        self.mean = _variable(nnx.BatchStat, jnp.zeros((c,), jnp.float32), (axis,))
        self.var = _variable(nnx.BatchStat, jnp.ones((c,), jnp.float32), (axis,))

    def __call__(self, x_bhwc: jax.Array, train: bool) -> jax.Array:
        """x [B, H, W, C] -> normalised x in x's dtype. train=True: the batch's statistics,
        and the running ones updated in place; train=False: the running ones."""
        x = x_bhwc.astype(jnp.float32)
        if train:
            mean = x.mean((0, 1, 2))
            var = jnp.square(x - mean).mean((0, 1, 2))  # two passes: no cancellation
            n = x.shape[0] * x.shape[1] * x.shape[2]
            unbiased = var * (n / max(n - 1, 1))
            # The statistics are state, not a function of the params the loss differentiates.
            self.mean[...] = BN_MOMENTUM * self.mean[...] + (1 - BN_MOMENTUM) * jax.lax.stop_gradient(mean)
            self.var[...] = BN_MOMENTUM * self.var[...] + (1 - BN_MOMENTUM) * jax.lax.stop_gradient(unbiased)
        else:
            mean, var = self.mean[...], self.var[...]
        y = (x - mean) * jax.lax.rsqrt(var + BN_EPSILON) * self.scale[...].astype(jnp.float32) \
            + self.bias[...].astype(jnp.float32)
        return y.astype(x_bhwc.dtype)


class ConvBN(nnx.Module):
    """conv -> BatchNorm (when `batch_norm`) -> ReLU (when `relu`), the output pinned to
    ("batch", "height", "width", axes[1])."""

    def __init__(self, rngs: nnx.Rngs, k: int, c_in: int, c_out: int, axes: tuple[str, str], *,
                 stride: int = 1, bias: bool = False, batch_norm: bool = True, relu: bool = True,
                 param_dtype="float32"):
        self.conv = Conv(rngs, k, c_in, c_out, axes, stride=stride, bias=bias, param_dtype=param_dtype)
        self.bn = BatchNorm(c_out, axes[1], param_dtype) if batch_norm else None
        self.relu = relu
        self.out_axes = ("batch", "height", "width", axes[1])

    def __call__(self, x_bhwc: jax.Array, constrain: Hook = UNSHARDED, train: bool = False) -> jax.Array:
        y = self.conv(x_bhwc)
        if self.bn is not None:
            y = self.bn(y, train)
        if self.relu:
            y = jax.nn.relu(y)
        return constrain(y, self.out_axes)


def max_pool(x_bhwc: jax.Array, window: int, stride: int, pad: int = 0) -> jax.Array:
    """Max over window x window patches, `pad` rows of -inf each side (PyTorch's MaxPool2d:
    output floor((H + 2 pad - window) / stride) + 1)."""
    return jax.lax.reduce_window(x_bhwc, -jnp.inf, jax.lax.max, (1, window, window, 1),
                                 (1, stride, stride, 1), ((0, 0), (pad, pad), (pad, pad), (0, 0)))


def pool_output_size(size: int, window: int, stride: int, pad: int = 0) -> int:
    return (size + 2 * pad - window) // stride + 1


def global_avg_pool(x_bhwc: jax.Array) -> jax.Array:
    """[B, H, W, C] -> [B, C], the mean over positions in float32, cast back."""
    return x_bhwc.astype(jnp.float32).mean((1, 2)).astype(x_bhwc.dtype)


class Dense(nnx.Module):
    """y = x w + b, w [in, out] (axes), normal(std) (torchvision's VGG classifier: 0.01),
    b [out] (axes[1]) zeros. With `padded` > out, the weight gets zero columns and the bias
    zeros up to `padded` (the classifier's output over the padded classes, `vocab`: the
    caller masks those logits, so they get no gradient)."""

    def __init__(self, rngs: nnx.Rngs, d_in: int, d_out: int, axes: tuple[str, str], *,
                 std: float = 0.01, padded: int | None = None, param_dtype="float32"):
        dt = jnp.dtype(param_dtype)
        padded = d_out if padded is None else padded
        w = std * jax.random.normal(rngs.params(), (d_in, d_out), dt)
        self.w = _variable(nnx.Param, jnp.pad(w, ((0, 0), (0, padded - d_out))), axes)
        self.b = _variable(nnx.Param, jnp.zeros((padded,), dt), (axes[1],))

    def __call__(self, x_bd: jax.Array) -> jax.Array:
        dt = x_bd.dtype
        return x_bd @ self.w[...].astype(dt) + self.b[...].astype(dt)


def check_remat(cfg) -> None:
    """The image families run their layers one by one, with no remat policy to apply."""
    if cfg.remat != "none":
        raise UserError(f"model.remat={cfg.remat!r}: the image families do not implement "
                        f"rematerialisation. Set model.remat=none.")
