"""Image classification: a label per image.

    batch   {"images": uint8 [B, H, W, C], "labels": int32 [B]}
    loss    mean cross entropy in float32 over the B images
    metrics top1, top5: the share of images whose label is the highest logit, or among
            the five highest; count: the images scored (a label of -1 marks a padding row,
            which the loss and metrics leave out: a finite eval split's last batch)
    unit    images: 1 per row

Pixels cross to the devices as uint8 (a quarter of float32's bytes) and are normalised
there, x = (images / 255 - mean) / std per channel, with the data's statistics
(`source.info["mean"]`, `["std"]`, in [0, 1] units).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from meshtrain.step.tasks.task import Field

IMAGE_AXES = ("batch", "height", "width", "image_channels")


class Classification:
    name = "classify"
    unit = "images"
    eval_metrics = ("top1", "top5")

    def __init__(self, mean: tuple[float, ...] = (0.5,), std: tuple[float, ...] = (0.5,)):
        self.mean, self.std = tuple(mean), tuple(std)

    @classmethod
    def from_data(cls, info: dict, data_cfg=None) -> "Classification":
        return cls(info.get("mean", (0.5,)), info.get("std", (0.5,)))

    def batch_fields(self, cfg, rows: int) -> dict[str, Field]:
        hw = cfg.image_size
        return {"images": Field((rows, hw, hw, cfg.image_channels), "uint8", IMAGE_AXES),
                "labels": Field((rows,), "int32", ("batch",))}

    def units_per_example(self, cfg) -> int:
        return 1

    @staticmethod
    def flops(family):
        return family.flops_per_example

    @staticmethod
    def source_args(dims: dict) -> dict:
        return {"seq_len": 0, "task": "classify", "image_size": dims["image_size"],
                "image_channels": dims.get("image_channels", 3)}

    @staticmethod
    def check_config(train, dims: dict) -> None:
        """Nothing the classifier refuses among train.* (loss_chunk is a sequence's)."""

    def normalise(self, images: jax.Array) -> jax.Array:
        """uint8 [B, H, W, C] -> float32, per channel (x / 255 - mean) / std."""
        x = images.astype(jnp.float32) / 255.0
        return (x - jnp.asarray(self.mean, jnp.float32)) / jnp.asarray(self.std, jnp.float32)

    def loss(self, module, batch, key, run_layers, *, constrain, layout, mesh, loss_chunk, train):
        x = constrain(self.normalise(batch["images"]), IMAGE_AXES)
        logits = module(x, constrain, key, train).astype(jnp.float32)  # [B, padded classes]
        labels = batch["labels"]
        # Label -1 marks a padding row (the last eval batch of a finite split): left out.
        valid = (labels >= 0).astype(jnp.float32)
        count = jnp.maximum(valid.sum(), 1.0)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(labels, 0))
        metrics = {k: (v * valid).sum() / count for k, v in top_k_hits(logits, labels).items()}
        return (ce * valid).sum() / count, {**metrics, "count": valid.sum()}


def top_k_hits(logits: jax.Array, labels: jax.Array) -> dict[str, jax.Array]:
    """{"top1", "top5"}: [B] float32, 1 where the label's logit is beaten by fewer than k
    others (ties counted for the label), from logits [B, V] and labels [B]."""
    own = jnp.take_along_axis(logits, jnp.maximum(labels, 0)[:, None], axis=1)  # [B, 1]
    rank = jnp.sum(logits > own, axis=1)                                       # [B] logits above the label's
    return {f"top{k}": (rank < k).astype(jnp.float32) for k in (1, 5)}
