"""ResNet (He et al. 2015, arXiv 1512.03385) in Flax NNX, logical axis names only.

torchvision's structure, "v1.5": the stride of a downsampling bottleneck is on its 3x3
conv, not its first 1x1. Every conv is followed by BatchNorm and has no bias; a block's
shortcut is the identity, or a 1x1 conv and BatchNorm where the block changes the width or
the resolution. Stem: a 7x7 stride-2 conv and a 3x3 stride-2 max-pool ("imagenet"), or a
3x3 stride-1 conv alone ("small", for 16-32 px images, as CIFAR ResNets do). Then a
global average pool and one fc layer. The last BatchNorm of each block starts at scale 1
(torchvision's default, zero_init_residual=False).

Channel tensor parallelism pairs the block's convs (see models/conv.py for the names):
  basic       3x3 channels -> filters, 3x3 filters -> channels
  bottleneck  1x1 channels -> channels, 3x3 channels -> filters, 1x1 filters -> channels
  shortcut    1x1 channels -> channels
so a block's output and the residual stream are `channels` (whole) and each pair costs
one all-reduce.

Shapes: B batch, H, W positions, C feature maps, V classes (padded).
"""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from meshtrain.errors import UserError
from meshtrain.models import family
from meshtrain.models.conv import ConvBN, ConvSpec, Dense, check_remat, conv_output_size, global_avg_pool, max_pool, pool_output_size
from meshtrain.models.hook import UNSHARDED, Hook
from meshtrain.models.stack import mask_padding

EXPANSION = {"basic": 1, "bottleneck": 4}  # block output width / its inner width
STEMS = ("imagenet", "small")


def _size(block: str, stages: str, *, width=64, stem="imagenet", image_size=224, classes=1000) -> dict:
    convs = sum(int(n) for n in stages.split()) * (2 if block == "basic" else 3)
    return dict(num_layers=convs + 2, vocab_size=classes, image_size=image_size, image_channels=3,
                batch_norm=True, block=block, stage_blocks=stages, width=width, stem=stem)


SIZES = {
    "resnet18": _size("basic", "2 2 2 2"),
    "resnet50": _size("bottleneck", "3 4 6 3"),
    # 16 px, the small stem, two stages of one basic block (16 and 32 wide), 10 classes.
    "tiny": _size("basic", "1 1", width=16, stem="small", image_size=16, classes=10),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResNetConfig(family.ModelConfig):
    image_size: int
    image_channels: int = 3
    batch_norm: bool
    block: str         # basic | bottleneck
    stage_blocks: str  # blocks per stage, "3 4 6 3"; stage i is width 2^i wide inside
    width: int         # the stem's and the first stage's inner width
    stem: str          # imagenet | small

    def stages(self) -> list[int]:
        return [int(n) for n in self.stage_blocks.split()]

    @property
    def out_dim(self) -> int:
        """Feature maps into the classifier."""
        return self.width * 2 ** (len(self.stages()) - 1) * EXPANSION[self.block]


def blocks(cfg: ResNetConfig):
    """(name, c_in, inner width, stride, height in) of each block, in order."""
    s = conv_output_size(cfg.image_size, 2 if cfg.stem == "imagenet" else 1)
    if cfg.stem == "imagenet":
        s = pool_output_size(s, 3, 2, 1)
    c_in, out = cfg.width, []
    for i, n in enumerate(cfg.stages()):
        w = cfg.width * 2 ** i
        for j in range(n):
            stride = 2 if i > 0 and j == 0 else 1
            out.append((f"stage{i + 1}_block{j + 1}", c_in, w, stride, s))
            s, c_in = conv_output_size(s, stride), w * EXPANSION[cfg.block]
    return out


def convs(cfg: ResNetConfig) -> list[ConvSpec]:
    """Every conv, in order, shortcuts included."""
    k, stride = (7, 2) if cfg.stem == "imagenet" else (3, 1)
    s = cfg.image_size
    out = [ConvSpec("stem", k, cfg.image_channels, cfg.width, stride, s, conv_output_size(s, stride),
                    ("image_channels", "channels"))]
    for name, c_in, w, stride, s in blocks(cfg):
        so = conv_output_size(s, stride)
        c_out = w * EXPANSION[cfg.block]
        if cfg.block == "basic":
            out += [ConvSpec(f"{name}/conv1", 3, c_in, w, stride, s, so, ("channels", "filters")),
                    ConvSpec(f"{name}/conv2", 3, w, w, 1, so, so, ("filters", "channels"))]
        else:
            out += [ConvSpec(f"{name}/conv1", 1, c_in, w, 1, s, s, ("channels", "channels")),
                    ConvSpec(f"{name}/conv2", 3, w, w, stride, s, so, ("channels", "filters")),
                    ConvSpec(f"{name}/conv3", 1, w, c_out, 1, so, so, ("filters", "channels"))]
        if stride != 1 or c_in != c_out:
            out.append(ConvSpec(f"{name}/shortcut", 1, c_in, c_out, stride, s, so, ("channels", "channels")))
    return out


class Block(nnx.Module):
    """A residual block: x -> relu(convs(x) + shortcut(x)), the output pinned to
    ("batch", "height", "width", "channels")."""

    def __init__(self, cfg: ResNetConfig, rngs: nnx.Rngs, c_in: int, w: int, stride: int):
        pd, c_out = cfg.param_dtype, w * EXPANSION[cfg.block]
        if cfg.block == "basic":
            self.conv1 = ConvBN(rngs, 3, c_in, w, ("channels", "filters"), stride=stride, param_dtype=pd)
            self.conv2 = ConvBN(rngs, 3, w, w, ("filters", "channels"), relu=False, param_dtype=pd)
            self.conv3 = None
        else:
            self.conv1 = ConvBN(rngs, 1, c_in, w, ("channels", "channels"), param_dtype=pd)
            self.conv2 = ConvBN(rngs, 3, w, w, ("channels", "filters"), stride=stride, param_dtype=pd)
            self.conv3 = ConvBN(rngs, 1, w, c_out, ("filters", "channels"), relu=False, param_dtype=pd)
        self.shortcut = (ConvBN(rngs, 1, c_in, c_out, ("channels", "channels"), stride=stride, relu=False,
                                param_dtype=pd) if stride != 1 or c_in != c_out else None)

    def __call__(self, x_bhwc: jax.Array, constrain: Hook, train: bool) -> jax.Array:
        y = self.conv2(self.conv1(x_bhwc, constrain, train), constrain, train)
        if self.conv3 is not None:
            y = self.conv3(y, constrain, train)
        sc = x_bhwc if self.shortcut is None else self.shortcut(x_bhwc, constrain, train)
        return constrain(jax.nn.relu(y + sc), ("batch", "height", "width", "channels"))


class ResNet(nnx.Module):
    def __init__(self, cfg: ResNetConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        pd = cfg.param_dtype
        big = cfg.stem == "imagenet"
        self.stem = ConvBN(rngs, 7 if big else 3, cfg.image_channels, cfg.width, ("image_channels", "channels"),
                           stride=2 if big else 1, param_dtype=pd)
        self.block_names = tuple(name for name, *_ in blocks(cfg))
        for name, c_in, w, stride, _ in blocks(cfg):
            setattr(self, name, Block(cfg, rngs, c_in, w, stride))
        self.fc = Dense(rngs, cfg.out_dim, cfg.vocab_size, ("channels", "vocab"), padded=cfg.padded_vocab_size,
                        param_dtype=pd)

    def __call__(self, images_bhwc: jax.Array, constrain: Hook = UNSHARDED,
                 key: jax.Array | None = None, train: bool = False) -> jax.Array:
        """images [B, H, W, C] float (normalised) -> logits [B, V] in the compute dtype, the
        padding classes masked. train: BatchNorm uses and updates the batch's statistics.
        key is unused (no dropout in a ResNet)."""
        del key
        cfg = self.cfg
        x = constrain(images_bhwc.astype(cfg.dtype), ("batch", "height", "width", "image_channels"))
        x = self.stem(x, constrain, train)
        if cfg.stem == "imagenet":
            x = constrain(max_pool(x, 3, 2, 1), ("batch", "height", "width", "channels"))
        for name in self.block_names:
            x = getattr(self, name)(x, constrain, train)
        x = constrain(global_avg_pool(x), ("batch", "channels"))
        return constrain(mask_padding(self.fc(x), cfg.vocab_size), ("batch", "vocab"))


def num_params(cfg: ResNetConfig) -> int:
    """Closed form: per conv k^2 C_in C_out + 2 C_out (its BatchNorm), then C V + V (classes unpadded)."""
    return sum(c.params + 2 * c.c_out for c in convs(cfg)) \
        + cfg.out_dim * cfg.vocab_size + cfg.vocab_size


def forward_macs(cfg: ResNetConfig) -> int:
    """Multiply-adds of one image's forward pass: convs (H_out W_out k^2 C_in C_out) and the fc."""
    return sum(c.macs for c in convs(cfg)) \
        + cfg.out_dim * cfg.vocab_size


def flops_per_example(cfg: ResNetConfig) -> float:
    """Training FLOPs per image = 3 x forward, forward = 2 x the multiply-adds of convs and the fc layer.
    (Pools, ReLU, BatchNorm and the residual adds are left out.)"""
    return 6.0 * forward_macs(cfg)


def activations(cfg: ResNetConfig, b: int):
    """(what, shape, logical axes) of the activations the forward pass constrains, one
    entry per distinct shape and axes (the first conv or block that makes it)."""
    s = cfg.image_size
    seen = {((b, s, s, cfg.image_channels), ("batch", "height", "width", "image_channels")): "images"}
    for c in convs(cfg):
        pinned = ("batch", "height", "width", c.axes[1])
        seen.setdefault(((b, c.h_out, c.h_out, c.c_out), pinned), f"{c.name} out")
        if c.name == "stem" and cfg.stem == "imagenet":
            sp = pool_output_size(c.h_out, 3, 2, 1)
            seen.setdefault(((b, sp, sp, c.c_out), pinned), "stem max-pool")
    seen.setdefault(((b, cfg.out_dim), ("batch", "channels")), "pooled features")
    seen.setdefault(((b, cfg.padded_vocab_size), ("batch", "vocab")), "logits")
    return [(what, shape, axes) for (shape, axes), what in seen.items()]


def _check(cfg: ResNetConfig) -> None:
    if cfg.block not in EXPANSION or cfg.stem not in STEMS:
        raise UserError(f"resnet block={cfg.block!r}, stem={cfg.stem!r}: the blocks are "
                        f"{', '.join(EXPANSION)} and the stems {', '.join(STEMS)}.")
    if not cfg.batch_norm:
        raise UserError("model.batch_norm=False: a resnet here always has BatchNorm (its convs have no "
                        "bias, and without normalisation a deep residual net needs a special "
                        "initialisation this code does not have). Unset model.batch_norm.")
    want = sum(not c.name.endswith("shortcut") for c in convs(cfg)) + 1
    if cfg.num_layers != want:
        raise UserError(f"model.num_layers={cfg.num_layers}: this resnet has {want} weight layers "
                        f"(convs outside the shortcuts, and the fc); the depth comes from model.size. "
                        f"Unset model.num_layers.")
    check_remat(cfg)


def describe(c: ResNetConfig) -> str:
    return (f"resnet: {c.num_layers} layers ({c.block} blocks {c.stage_blocks}, width {c.width}, "
            f"{c.stem} stem), {c.image_size} px x {c.image_channels}, {c.vocab_size} classes "
            f"(padded {c.padded_vocab_size}), params {c.param_dtype}")


FAMILY = family.register(family.Family(
    name="resnet", config=ResNetConfig, module=ResNet, sizes=SIZES, activations=activations,
    num_params=num_params, flops_per_token=None, flops_per_example=flops_per_example,
    task="classify", stacked=None,
    size_keys={"height": "the activation height (model.image_size over the strides before it)",
               "width": "the activation width (model.image_size over the strides before it)",
               "channels": "a block width of model.size", "filters": "a block's inner width (model.size)",
               "image_channels": "the images' colour channels",
               "vocab": "the classes (padded to model.vocab_multiple)"},
    describe=describe, check=_check, convs=convs,
))
