"""VGG (Simonyan and Zisserman 2014, arXiv 1409.1556) in Flax NNX, logical axis names only.

The sizes are torchvision's configurations A, B, D, E (VGG-11, 13, 16, 19), with and
without BatchNorm: 3x3 convs (bias on, torchvision keeps it under BatchNorm too), ReLU,
2x2 max-pools, then a classifier flatten -> fc1 (mlp) -> ReLU -> dropout -> fc2 -> ReLU ->
dropout -> fc3 (classes). Dropout is model.dropout (the published model used 0.5; the
default here is 0).

At 224 px the features are 7 x 7, what torchvision's adaptive average pool makes them, so
the parameters are the published ones. At other sizes there is no adaptive pool: the
classifier takes the features as they are, (image_size // 32)^2 x 512 inputs for fc1
(CIFAR's 32 px: 512), and `num_params` counts that.

Channel tensor parallelism: consecutive convs alternate their output between `channels`
(kept whole) and `filters` (split), the last conv's output being `channels`, so each
(channels -> filters, filters -> channels) pair needs one all-reduce, and the features
reach the classifier whole. The first conv reads `image_channels` (3, never split).

Shapes: B batch, H, W positions, C feature maps, D flattened features / fc2 width,
F fc1 width (`mlp`), V classes (padded).
"""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from meshtrain.errors import UserError
from meshtrain.models import family
from meshtrain.models.conv import ConvBN, ConvSpec, Dense, check_remat, max_pool
from meshtrain.models.hook import UNSHARDED, Hook
from meshtrain.models.stack import dropout as _dropout, mask_padding

# torchvision's cfgs: a width is a 3x3 conv, M a 2x2 max-pool of stride 2.
_A = "64 M 128 M 256 256 M 512 512 M 512 512 M"
_B = "64 64 M 128 128 M 256 256 M 512 512 M 512 512 M"
_D = "64 64 M 128 128 M 256 256 256 M 512 512 512 M 512 512 512 M"
_E = "64 64 M 128 128 M 256 256 256 256 M 512 512 512 512 M 512 512 512 512 M"


def _size(plan: str, batch_norm: bool, image_size=224, mlp=4096, classes=1000) -> dict:
    convs = sum(t != "M" for t in plan.split())
    return dict(num_layers=convs + 3, vocab_size=classes, image_size=image_size, image_channels=3,
                batch_norm=batch_norm, conv_plan=plan, mlp_dim=mlp)


SIZES = {
    **{f"vgg{n}": _size(p, False) for n, p in ((11, _A), (13, _B), (16, _D), (19, _E))},
    **{f"vgg{n}_bn": _size(p, True) for n, p in ((11, _A), (13, _B), (16, _D), (19, _E))},
    # 16 px, 4 convs with BatchNorm, a 64-wide classifier, 10 classes: compiles in seconds on a CPU.
    "tiny": _size("16 16 M 32 32 M", True, image_size=16, mlp=64, classes=10),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class VGGConfig(family.ModelConfig):
    image_size: int
    image_channels: int = 3
    batch_norm: bool
    conv_plan: str  # "64 64 M 128 ...": conv widths and max-pools in order
    mlp_dim: int    # fc1 and fc2 width

    def plan(self) -> list[int | str]:
        return [t if t == "M" else int(t) for t in self.conv_plan.split()]

    def conv_axes(self) -> list[tuple[str, str]]:
        """(in, out) logical names of each conv, alternating so that the last outputs `channels`."""
        n = sum(t != "M" for t in self.plan())
        outs = ["channels" if (n - 1 - i) % 2 == 0 else "filters" for i in range(n)]
        return list(zip(["image_channels", *outs[:-1]], outs))

    def feature_shape(self) -> tuple[int, int]:
        """(H = W, C) of the features the classifier flattens."""
        s, c = self.image_size, self.image_channels
        for t in self.plan():
            s, c = (s // 2, c) if t == "M" else (s, t)
        return s, c

    @property
    def flat_dim(self) -> int:
        s, c = self.feature_shape()
        return s * s * c


class VGG(nnx.Module):
    def __init__(self, cfg: VGGConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        pd = cfg.param_dtype
        c_in, axes = cfg.image_channels, iter(cfg.conv_axes())
        self.conv_names: tuple[str, ...] = ()
        for t in cfg.plan():
            if t == "M":
                continue
            name = f"conv{len(self.conv_names) + 1}"
            setattr(self, name, ConvBN(rngs, 3, c_in, t, next(axes), bias=True, batch_norm=cfg.batch_norm,
                                       param_dtype=pd))
            self.conv_names += (name,)
            c_in = t
        self.fc1 = Dense(rngs, cfg.flat_dim, cfg.mlp_dim, ("embed", "mlp"), param_dtype=pd)
        self.fc2 = Dense(rngs, cfg.mlp_dim, cfg.mlp_dim, ("mlp", "embed"), param_dtype=pd)
        self.fc3 = Dense(rngs, cfg.mlp_dim, cfg.vocab_size, ("embed", "vocab"), padded=cfg.padded_vocab_size,
                         param_dtype=pd)

    def __call__(self, images_bhwc: jax.Array, constrain: Hook = UNSHARDED,
                 key: jax.Array | None = None, train: bool = False) -> jax.Array:
        """images [B, H, W, C] float (normalised) -> logits [B, V] in the compute dtype, the
        padding classes masked. train: BatchNorm uses and updates the batch's statistics;
        key: dropout's randomness (None: no dropout)."""
        cfg = self.cfg
        x = constrain(images_bhwc.astype(cfg.dtype), ("batch", "height", "width", "image_channels"))
        names, out_axes = iter(self.conv_names), ("batch", "height", "width", "image_channels")
        plan = cfg.plan()
        for i, t in enumerate(plan):
            if t == "M":
                # The features' final pool is not pinned: the flatten right after is. So a
                # spatial layout need not divide its height (7 at 224 px), only the convs'.
                x = max_pool(x, 2, 2)
                x = x if i == len(plan) - 1 else constrain(x, out_axes)
            else:
                layer = getattr(self, next(names))
                x, out_axes = layer(x, constrain, train), layer.out_axes
        b = x.shape[0]
        x = constrain(x.reshape(b, -1), ("batch", "embed"))  # (h, w, c) order, NHWC
        keys = (None, None) if key is None else tuple(jax.random.split(key))
        x = constrain(_dropout(jax.nn.relu(self.fc1(x)), cfg.dropout, keys[0]), ("batch", "mlp"))
        x = constrain(_dropout(jax.nn.relu(self.fc2(x)), cfg.dropout, keys[1]), ("batch", "embed"))
        return constrain(mask_padding(self.fc3(x), cfg.vocab_size), ("batch", "vocab"))


def convs(cfg: VGGConfig) -> list[ConvSpec]:
    """Every conv, in order (3x3, stride 1)."""
    s, c_in, axes, out = cfg.image_size, cfg.image_channels, iter(cfg.conv_axes()), []
    for t in cfg.plan():
        if t == "M":
            s //= 2
        else:
            out.append(ConvSpec(f"conv{len(out) + 1}", 3, c_in, t, 1, s, s, next(axes)))
            c_in = t
    return out


def _pools_after(cfg: VGGConfig) -> set[int]:
    """The numbers (from 1) of the convs a max-pool follows."""
    out, i = set(), 0
    for t in cfg.plan():
        if t == "M":
            out.add(i)
        else:
            i += 1
    return out


def num_params(cfg: VGGConfig) -> int:
    """Closed form: per conv 9 C_in C_out + C_out (+ 2 C_out with BatchNorm); then
    D F + F + F F + F + F V + V with D the flattened features (classes unpadded)."""
    weights = sum(c.params + c.c_out + (2 * c.c_out if cfg.batch_norm else 0) for c in convs(cfg))
    d, f, v = cfg.flat_dim, cfg.mlp_dim, cfg.vocab_size
    return weights + d * f + f + f * f + f + f * v + v


def forward_macs(cfg: VGGConfig) -> int:
    """Multiply-adds of one image's forward pass: convs (H W 9 C_in C_out at stride 1) and
    the three fc layers (classes unpadded)."""
    d, f, v = cfg.flat_dim, cfg.mlp_dim, cfg.vocab_size
    return sum(c.macs for c in convs(cfg)) + d * f + f * f + f * v


def flops_per_example(cfg: VGGConfig) -> float:
    """Training FLOPs per image = 3 x forward, forward = 2 x the multiply-adds of convs and fc layers.
    (Pools, ReLU, BatchNorm and biases are left out, as 6 N leaves out a transformer's norms.)"""
    return 6.0 * forward_macs(cfg)


def activations(cfg: VGGConfig, b: int):
    """(what, shape, logical axes) of every activation the forward pass constrains (one
    entry per distinct shape and axes)."""
    s0, v = cfg.image_size, cfg.padded_vocab_size
    out = [("images", (b, s0, s0, cfg.image_channels), ("batch", "height", "width", "image_channels"))]
    all_convs = convs(cfg)
    for i, c in enumerate(all_convs, 1):
        pinned = ("batch", "height", "width", c.axes[1])
        out.append((f"{c.name} out", (b, c.h_out, c.h_out, c.c_out), pinned))
        if i in _pools_after(cfg) and i < len(all_convs):  # the last pool is not pinned (see VGG.__call__)
            out.append((f"pool after {c.name}", (b, c.h_out // 2, c.h_out // 2, c.c_out), pinned))
    out += [("flattened features", (b, cfg.flat_dim), ("batch", "embed")),
            ("fc1 out", (b, cfg.mlp_dim), ("batch", "mlp")),
            ("fc2 out", (b, cfg.mlp_dim), ("batch", "embed")),
            ("logits", (b, v), ("batch", "vocab"))]
    return out


def _check(cfg: VGGConfig) -> None:
    plan = cfg.conv_plan.split()
    if any(t != "M" and not t.isdigit() for t in plan) or not plan or plan[0] == "M":
        raise UserError(f"vgg conv_plan={cfg.conv_plan!r}: write conv widths and M (max-pool), "
                        f"starting with a conv, e.g. '64 M 128 M'.")
    convs, pools = sum(t != "M" for t in plan), plan.count("M")
    if cfg.num_layers != convs + 3:
        raise UserError(f"model.num_layers={cfg.num_layers}: a vgg with {convs} convs and 3 fc layers "
                        f"has {convs + 3} weight layers; the depth comes from model.size. Unset "
                        f"model.num_layers.")
    if cfg.image_size < 2 ** pools:
        raise UserError(f"model.image_size={cfg.image_size} is too small for vgg ({cfg.num_layers} "
                        f"layers): its {pools} max-pools each halve the height, so the features "
                        f"would be empty. Use model.image_size >= {2 ** pools} (224 is the published "
                        f"size), or a smaller model.size such as tiny.")
    check_remat(cfg)


def describe(c: VGGConfig) -> str:
    s, ch = c.feature_shape()
    return (f"vgg: {c.num_layers} layers ({c.num_layers - 3} convs{', BatchNorm' if c.batch_norm else ''}, "
            f"3 fc, fc width {c.mlp_dim}), {c.image_size} px x {c.image_channels}, features "
            f"{s}x{s}x{ch}, {c.vocab_size} classes (padded {c.padded_vocab_size}), params {c.param_dtype}")


FAMILY = family.register(family.Family(
    name="vgg", config=VGGConfig, module=VGG, sizes=SIZES, activations=activations,
    num_params=num_params, flops_per_token=None, flops_per_example=flops_per_example,
    task="classify", stacked=None,
    size_keys={"height": "the activation height (model.image_size halved by each pool before it)",
               "width": "the activation width (model.image_size halved by each pool before it)",
               "channels": "a conv width of model.size", "filters": "a conv width of model.size",
               "image_channels": "the images' colour channels",
               "embed": "the classifier width (flattened features, fc2)", "mlp": "the fc1 width",
               "vocab": "the classes (padded to model.vocab_multiple)"},
    describe=describe, check=_check, convs=convs,
))
