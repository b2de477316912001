"""data.kind=images from TFDS ArrayRecord datasets (features 'image' and 'label').

Catalog datasets a user has prepared (`tfds build cifar10 --file_format=array_record`,
imagenet2012 likewise) and folders written by `python -m meshtrain.data.prepare
--images=DIR` read the same way: `tfds` opens the split's records with the image
left encoded (`SkipDecoding`), and meshtrain decodes it with PIL at the size the
crop needs (meshtrain/data/image_transforms.py). Nothing here downloads.

Mean and std per channel: the standard values for imagenet2012, cifar10 and
cifar100 (below); for any other dataset, measured at start on up to 512 evenly
spaced training images (eval transform), which every process computes alike.
"""

import numpy as np
import tensorflow_datasets as tfds

from meshtrain.data import image_transforms as transforms
from meshtrain.data.image_source import SMALL_IMAGE, ImageSource, sized_source
from meshtrain.data.tfds_source import check_splits, open_builder
from meshtrain.errors import UserError

# Per-channel (R, G, B) mean and std of the training pixels in [0, 1] units.
# ImageNet: the values torchvision's models were trained with. CIFAR: over all
# 50,000 training images' pixels (not the mean of per-image stds).
KNOWN_STATS = {
    "imagenet2012": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}


def make_tfds_image_source(data_cfg, *, image_size: int, channels: int,
                           seed: int) -> ImageSource:
    name, data_dir = data_cfg.get("name"), data_cfg.get("data_dir") or None
    split = data_cfg.get("split") or "train"
    eval_split = data_cfg.get("eval_split") or "validation"
    builder = open_builder(name, data_dir, input_flag="--images=DIR")
    check_splits(builder, (split, eval_split))
    features = builder.info.features
    missing = [f for f in ("image", "label") if f not in features.keys()]
    if missing:
        raise UserError(
            f"TFDS dataset {builder.name!r} is not an image classification dataset: it has "
            f"no feature {missing[0]!r} (its features are {sorted(features.keys())}). "
            f"data.kind=images reads features 'image' and 'label', as cifar10, imagenet2012 "
            f"and `prepare --images` datasets have.")
    sources = builder.as_data_source(decoders={"image": tfds.decode.SkipDecoding()})
    base = builder.name.split(":")[0].split("/")[0]
    stored = tuple(features["image"].shape)  # (H, W, C), None where sizes vary
    augment = data_cfg.get("augment", "auto")
    if augment == "auto":
        small = None not in stored[:2] and max(stored[:2]) <= SMALL_IMAGE
        augment = "flip" if small else "crop_flip"
    known = KNOWN_STATS.get(base) if channels == 3 else None

    def read(records):
        return ([transforms.open_encoded(r["image"]) for r in records],
                np.array([r["label"] for r in records], np.int32))

    return sized_source(
        name=builder.name, num_classes=int(features["label"].num_classes),
        image_size=image_size, channels=channels, seed=seed, augment=augment,
        crop_scale=data_cfg.get("crop_scale", 0.08), splits=[split, eval_split],
        train=sources[split], evals=sources[eval_split], read=read,
        mean_std=known, info={"data_dir": str(builder.data_dir), "stored_shape": list(stored),
                              **({"mean_std_from": f"the standard {base} values"}
                                 if known else {})})
