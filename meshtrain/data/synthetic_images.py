"""Synthetic images with a known best accuracy: class patterns, bounded noise, label noise.

Class k has a pattern: a g x g x C grid of bits (g = min(4, size)), distinct
between classes, blown up to size x size by nearest neighbour. Example n of a
stream draws its class y uniformly, and its pixels are

    pixel = 64 + 128 * bit + noise,   noise uniform on the integers [-63, 63],

so a pixel is in [1, 255] (no clipping) and is >= 128 exactly when its bit is 1:
the image determines y without error. The label is y with probability
1 - LABEL_NOISE, else one of the other classes uniformly. Given the image, the
best guess is therefore y, and the best possible accuracy is exactly
1 - LABEL_NOISE (`info["best_accuracy"]`), for train and eval alike.

Mean and std per channel are exact, from the patterns: classes are equally
likely and the noise has mean 0, so the mean is the prototypes' and the variance
is the prototypes' about it plus the noise's, (127^2 - 1) / 12.

Example n of a stream is a function of (seed, stream, n) only.
"""

import functools

import grain
import numpy as np

from meshtrain.data.image_source import ImageSource
from meshtrain.errors import UserError

LABEL_NOISE = 0.1
GRID = 4
LOW, HIGH, NOISE = 64, 192, 63  # HIGH - NOISE = 129 > 128 > 127 = LOW + NOISE
TRAIN_STREAM, EVAL_STREAM = 0, 1
_STRUCTURE_TAG = 0x1A6E5


class ImagePatterns:
    """The class patterns of one (classes, size, channels, seed).

    Attributes:
      bits: [classes, g, g, channels] uint8 in {0, 1}, distinct between classes.
      prototypes: [classes, size, size, channels] uint8, 64 or 192 (the noise-free images).
    """

    def __init__(self, num_classes: int, size: int, channels: int, seed: int):
        g = min(GRID, size)
        if num_classes > 2 ** (g * g * channels):
            raise UserError(
                f"Synthetic images of {size}x{size}x{channels} carry {g * g * channels} bits "
                f"per class pattern, too few for {num_classes} distinct classes. Use a larger "
                f"model.image_size or fewer classes (model.vocab_size).")
        self.num_classes, self.size, self.channels, self.seed = num_classes, size, channels, seed
        rng = np.random.default_rng([seed, _STRUCTURE_TAG])
        bits = rng.integers(0, 2, (num_classes, g, g, channels), np.uint8)
        while True:  # redraw repeated patterns (rare beyond a few classes)
            _, first = np.unique(bits.reshape(num_classes, -1), axis=0, return_index=True)
            dup = np.setdiff1d(np.arange(num_classes), first)
            if dup.size == 0:
                break
            bits[dup] = rng.integers(0, 2, (dup.size, g, g, channels), np.uint8)
        self.bits = bits

    @functools.cached_property
    def prototypes(self) -> np.ndarray:
        # Built when examples are first drawn, never for a plan or a lint: 150 MB at
        # ImageNet's 1000 classes of 224 x 224 x 3, half a CPU-second.
        cell = np.arange(self.size) * self.bits.shape[1] // self.size  # pixel -> grid cell
        return (LOW + (HIGH - LOW) * self.bits[:, cell][:, :, cell]).astype(np.uint8)

    def examples(self, stream: int, ids: np.ndarray) -> dict[str, np.ndarray]:
        """Examples `ids` of `stream`; [rows] -> images uint8 [rows, S, S, C], labels int32
        [rows], and the true classes int32 [rows] under "classes" (for tests)."""
        s, c, k = self.size, self.channels, self.num_classes
        images = np.empty((len(ids), s, s, c), np.uint8)
        classes = np.empty(len(ids), np.int32)
        labels = np.empty(len(ids), np.int32)
        for row, n in enumerate(ids):
            rng = np.random.default_rng([self.seed, stream, int(n)])
            y = int(rng.integers(k))
            noise = rng.integers(-NOISE, NOISE + 1, (s, s, c), np.int16)
            images[row] = self.prototypes[y] + noise
            wrong = rng.random() < LABEL_NOISE
            classes[row] = y
            labels[row] = (y + 1 + rng.integers(k - 1)) % k if wrong else y
        return {"images": images, "labels": labels, "classes": classes}

    def classify(self, images: np.ndarray) -> np.ndarray:
        """The Bayes classifier: threshold each pixel, match the pattern; -> int32 [rows]."""
        on = (images >= 128).reshape(len(images), -1).astype(np.int32)
        protos = (self.prototypes >= 128).reshape(self.num_classes, -1).astype(np.int32)
        return (on @ protos.T + (1 - on) @ (1 - protos).T).argmax(axis=1).astype(np.int32)

    def info(self) -> dict:
        # Per channel, the prototypes' pixels are LOW or HIGH: their mean and variance follow
        # from the share of HIGH pixels, each grid cell weighted by the pixels it covers
        # (never from the [classes, S, S, C] prototypes in float64: 1.2 GB at ImageNet's size).
        g = self.bits.shape[1]
        per_cell = np.bincount(np.arange(self.size) * g // self.size, minlength=g) / self.size
        high = np.einsum("kijc,i,j->c", self.bits.astype(np.float64), per_cell, per_cell) / self.num_classes
        mean = LOW + (HIGH - LOW) * high
        var = (HIGH - LOW) ** 2 * high * (1 - high) + ((2 * NOISE + 1) ** 2 - 1) / 12
        return {"kind": "synthetic", "name": "synthetic_images", "num_classes": self.num_classes,
                "vocab_size": self.num_classes, "image_size": self.size,
                "channels": self.channels, "seed": self.seed, "label_noise": LABEL_NOISE,
                "best_accuracy": 1 - LABEL_NOISE, "mean": (mean / 255).tolist(),
                "std": (np.sqrt(var) / 255).tolist(), "augment": ""}


def make_synthetic_image_source(*, num_classes: int, image_size: int, channels: int,
                                seed: int) -> ImageSource:
    """An ImageSource of pattern images; train and eval use disjoint streams."""
    patterns = ImagePatterns(num_classes, image_size, channels, seed)

    def read(stream):
        def reader(ids):
            ex = patterns.examples(stream, ids)
            return {"images": ex["images"], "labels": ex["labels"]}
        return reader

    ids = grain.MapDataset.range(2**62)  # example n of a stream is its own draw
    return ImageSource(num_classes=num_classes, info=patterns.info(),
                       train_ids=ids, read_train=read(TRAIN_STREAM),
                       eval_ids=ids, read_eval=read(EVAL_STREAM))
