"""`ImageSource`: batches of images and labels, split across processes, on grain.

The same machinery as text (meshtrain/data/source.py): a stream of example ids
and a vectorised reader, so global batch b holds stream positions
b * B ... (b + 1) * B - 1, process p of P reads rows [p B / P, (p + 1) B / P), and
resuming is random access. A batch is

    {"images": uint8 [rows, S, S, C], "labels": int32 [rows]}

A training reader is given stream positions (not example ids): it maps them to
examples through the seeded, per-epoch shuffle and draws each example's crop and
flip from (seed, position), so the pixels of a position never depend on who
reads it or when.

`data.kind=images` datasets:
  digits: scikit-learn's bundled 8 x 8 handwritten digits (1,797 images, 10
    classes; no download), upscaled bilinearly to the model's size. Splits
    'train' (1,438) and 'test' (359): a fixed stratified split (20% of every
    class, rounded, chosen by a seeded permutation that train.seed does not change).
  anything else: a TFDS ArrayRecord dataset (meshtrain/data/image_records.py).
"""

import functools
import hashlib
import json

import grain
import numpy as np

from meshtrain.data import image_transforms as transforms
from meshtrain.data.source import DataSource
from meshtrain.errors import UserError

# data.augment="auto" for datasets whose images are this small or smaller (CIFAR's
# 32 px): a random-resized crop down to 8% of the area is too much for them.
SMALL_IMAGE = 64
DIGITS_TEST_FRACTION = 0.2
_DIGITS_SPLIT_SEED = 0x0D161

# Keys of `info` that name the example stream (what a saved state belongs to).
_STREAM_KEYS = ("kind", "name", "splits", "num_classes", "image_size", "channels", "seed",
                "augment", "crop_scale", "train_examples", "label_noise")


class ImageSource(DataSource):
    """Train and eval images of one dataset, as text's DataSource with dict batches.

    Attributes:
      vocab_size, num_classes: labels are in [0, num_classes).
      image_size, channels: batches hold uint8 [rows, image_size, image_size, channels].
      info: JSON facts for run.json, with num_classes, image_size, channels, and mean
        and std per channel in [0, 1] units (x = (images / 255 - mean) / std).
    """

    def __init__(self, *, num_classes: int, info: dict, train_ids: grain.MapDataset,
                 read_train, eval_ids: grain.MapDataset, read_eval):
        super().__init__(vocab_size=num_classes, seq_len=0, info=info, train_ids=train_ids,
                         read_train=read_train, eval_ids=eval_ids, read_eval=read_eval)
        self.num_classes = num_classes
        self.image_size, self.channels = info["image_size"], info["channels"]

    def fingerprint(self) -> str:
        """Names the example stream (dataset, splits, size, seed, augmentation)."""
        ident = {k: self.info.get(k) for k in _STREAM_KEYS}
        return hashlib.sha1(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:16]


def check_augment(augment, crop_scale) -> None:
    if augment != "auto" and augment not in transforms.AUGMENTS:
        raise UserError(
            f"data.augment={augment!r} is not known. Use one of 'auto' (the dataset's "
            f"default), '' (none), 'flip', 'crop' or 'crop_flip' (random-resized crop and "
            f"horizontal flip).")
    if not (isinstance(crop_scale, (int, float)) and 0 < crop_scale <= 1):
        raise UserError(
            f"data.crop_scale={crop_scale!r}: the smallest crop's share of the image area "
            f"must be in (0, 1]; Inception's (and the default) is 0.08.")


def sized_source(*, name: str, num_classes: int, image_size: int, channels: int, seed: int,
                 augment: str, crop_scale: float, splits: list, train, evals, read,
                 mean_std: tuple | None, info: dict) -> ImageSource:
    """An ImageSource over two random-access splits of records.

    Args:
      train, evals: (len, __getitems__) sources; `read(records)` -> (list of PIL
        images (lazy), int32 labels [rows]).
      mean_std: known per-channel mean and std, or None to measure them on up to
        512 evenly spaced training images (eval transform).
    """
    n_train, n_eval = len(train), len(evals)
    for split, n in zip(splits, (n_train, n_eval)):
        if n == 0:
            raise UserError(f"Image dataset {name!r} has no examples in split {split!r}. "
                            f"Set data.split and data.eval_split to non-empty splits.")
    order = grain.MapDataset.range(n_train).shuffle(seed=seed).repeat()  # reshuffled per epoch

    def batch(records, positions):
        images, labels = read(records)
        h = np.array([im.height for im in images])
        w = np.array([im.width for im in images])
        boxes, flips = transforms.boxes_for(h, w, train=positions is not None, augment=augment,
                                    crop_scale=crop_scale, seed=seed, positions=positions)
        return {"images": transforms.render_batch(images, boxes, flips, image_size, channels),
                "labels": labels}

    def read_train(positions):
        ids = [order[int(p)] for p in positions]
        return batch(train.__getitems__(ids), positions)

    def read_eval(ids):
        # Positions past the split are padding rows, labelled -1: the classify task leaves
        # them out, so an eval over ceil(n / B) batches scores every image exactly once.
        out = batch(evals.__getitems__([max(int(i), 0) for i in ids]), None)
        out["labels"] = np.where(np.asarray(ids) >= 0, out["labels"], -1).astype(out["labels"].dtype)
        return out

    if mean_std is None:
        sample = np.linspace(0, n_train - 1, min(n_train, 512)).astype(np.int64)
        mean_std = pixel_stats(batch(train.__getitems__([int(i) for i in sample]), None)["images"])
        info = dict(info, mean_std_from=f"{len(sample)} training images")
    info = dict(info, kind="images", name=name, splits=list(splits), num_classes=num_classes,
                vocab_size=num_classes, image_size=image_size, channels=channels, seed=seed,
                augment=augment, crop_scale=crop_scale if "crop" in augment else None,
                eval_crop=transforms.EVAL_CROP if "crop" in augment else 1.0,
                train_examples=n_train, eval_examples=n_eval,
                mean=[float(m) for m in mean_std[0]], std=[float(s) for s in mean_std[1]])
    return ImageSource(num_classes=num_classes, info=info,
                       train_ids=grain.MapDataset.range(2**62), read_train=read_train,
                       eval_ids=grain.MapDataset.range(2**62).map(lambda p: p if p < n_eval else -1),
                       read_eval=read_eval)


def pixel_stats(images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and std in [0, 1] units of uint8 [n, H, W, C]."""
    x = images.reshape(-1, images.shape[-1]).astype(np.float64) / 255
    return x.mean(axis=0), x.std(axis=0)


# --- digits: scikit-learn's bundled 8 x 8 images -------------------------------------

class _Rows:
    """Random access to rows of arrays, as a TFDS data source gives records."""

    def __init__(self, images: np.ndarray, labels: np.ndarray):
        self.images, self.labels = images, labels

    def __len__(self):
        return len(self.labels)

    def __getitems__(self, ids):
        return [(self.images[i], self.labels[i]) for i in ids]


def digits_split(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Train and test indices of the digits: 20% of every class held out, by a fixed
    seeded permutation; the test order is shuffled (any prefix is a fair sample)."""
    test = []
    for k in np.unique(labels):
        members = np.flatnonzero(labels == k)
        perm = np.random.default_rng([_DIGITS_SPLIT_SEED, int(k)]).permutation(members)
        test.append(perm[: round(DIGITS_TEST_FRACTION * len(members))])
    test = np.random.default_rng(_DIGITS_SPLIT_SEED).permutation(np.concatenate(test))
    train = np.setdiff1d(np.arange(len(labels)), test)
    return train, test


def upscale(images: np.ndarray, size: int) -> np.ndarray:
    """Bilinear resize (pixel centres aligned, as PIL and jax.image.resize) of float
    [n, h, h] to [n, size, size]: one interpolation matrix per axis."""
    h = images.shape[1]
    src = np.clip((np.arange(size) + 0.5) * h / size - 0.5, 0, h - 1)
    lo = np.floor(src).astype(int)
    hi = np.minimum(lo + 1, h - 1)
    a = np.zeros((size, h))
    a[np.arange(size), lo] += 1 - (src - lo)
    a[np.arange(size), hi] += src - lo
    return np.einsum("ih,nhw,jw->nij", a, images, a)


@functools.lru_cache(maxsize=4)
def digits_pixels(image_size: int, channels: int) -> tuple[np.ndarray, np.ndarray, dict, dict]:
    """scikit-learn's digits at `image_size`, read-only and built once per process (0.2
    CPU-s each, and every experiment on them builds its source): uint8 [1797, size,
    size, channels] images, int32 [1797] labels, {"train", "test"} indices, and each
    split's pixel_stats."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise UserError(
            "data.name=digits reads scikit-learn's bundled digits, but scikit-learn is not "
            "installed. Install it with `pip install scikit-learn`, or install meshtrain with "
            "its images extra (`pip install -e '.[images]'` in a checkout).") from None
    d = load_digits()
    pixels = np.round(upscale(d.images * (255 / 16), image_size)).clip(0, 255).astype(np.uint8)
    images = np.repeat(pixels[..., None], channels, axis=-1)  # grey to every channel
    labels = d.target.astype(np.int32)
    parts = dict(zip(("train", "test"), digits_split(labels)))
    stats = {name: pixel_stats(images[rows]) for name, rows in parts.items()}
    for table in (images, labels, *parts.values(), *(a for pair in stats.values() for a in pair)):
        table.flags.writeable = False
    return images, labels, parts, stats


def make_digits_source(data_cfg, *, image_size: int, channels: int, seed: int) -> ImageSource:
    images, labels, parts, stats = digits_pixels(image_size, channels)
    split, eval_split = data_cfg.get("split") or "train", data_cfg.get("eval_split") or "test"
    for s in (split, eval_split):
        if s not in parts:
            raise UserError(
                f"The digits dataset has splits 'train' (1,438 images) and 'test' (359); "
                f"got {s!r}. Set data.split=train and data.eval_split=test.")
    augment = data_cfg.get("augment", "auto")
    augment = "" if augment == "auto" else augment
    train_rows = _Rows(images[parts[split]], labels[parts[split]])

    def read(records):
        return ([transforms.from_array(img) for img, _ in records],
                np.array([lab for _, lab in records], np.int32))

    return sized_source(
        name="digits", num_classes=10, image_size=image_size, channels=channels, seed=seed,
        augment=augment, crop_scale=data_cfg.get("crop_scale", 0.08), splits=[split, eval_split],
        train=train_rows, evals=_Rows(images[parts[eval_split]], labels[parts[eval_split]]),
        read=read, mean_std=stats[split],
        info={"source": "sklearn.datasets.load_digits",
              "mean_std_from": "the training split"})
