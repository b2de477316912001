"""An ImageFolder (one subfolder of image files per class) as a TFDS ArrayRecord dataset.

    DIR/cat/001.jpg, DIR/cat/002.png, DIR/dog/a.jpg, ...  ->  DATA_DIR/NAME/1.0.0/

Features 'image' (tfds.features.Image: the encoded file) and 'label'
(tfds.features.ClassLabel, the subfolder names in sorted order), as cifar10 and
imagenet2012 have, so meshtrain/data/image_records.py reads both alike and so does
`tfds.data_source(NAME, data_dir=DATA_DIR)` anywhere.

Splits 'train' and 'validation': the last `val_fraction` of every class's files
(sorted by name; at least one where a class has two or more) are held out. Each
split is written in a fixed shuffled order, so a prefix of the validation split
(a short eval) samples every class. JPEG and PNG files are stored byte for byte;
others, and files of another colour mode than the dataset's (grey when every
file is grey, else RGB), are stored as lossless PNGs of their pixels.
"""

import io
from pathlib import Path

import numpy as np
import tensorflow_datasets as tfds
from PIL import Image, UnidentifiedImageError

from meshtrain.data.tfds_writer import write_dataset
from meshtrain.errors import UserError

FORMAT = "meshtrain.images/1"
SPLITS = ("train", "validation")
_ORDER_SEED = 0x1A6E


def scan_folder(root) -> tuple[list[str], list[tuple[Path, int]]]:
    """Class names (sorted subfolders) and (file, label) pairs, files sorted per class."""
    root = Path(root).expanduser()
    if not root.is_dir():
        raise UserError(f"--images={str(root)!r} is not a directory. Pass a folder with one "
                        f"subfolder of image files per class (the ImageFolder layout).")
    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    files = [(f, k) for k, c in enumerate(classes)
             for f in sorted((root / c).rglob("*")) if f.is_file() and not f.name.startswith(".")]
    if len(classes) < 2 or not files:
        raise UserError(
            f"--images={str(root)!r} has {len(classes)} class subfolder(s) and {len(files)} "
            f"file(s); a classification dataset needs at least 2 classes (subfolders) with "
            f"image files in them, e.g. DIR/cat/1.jpg and DIR/dog/1.jpg.")
    return classes, files


def split_files(files: list[tuple[Path, int]], val_fraction: float) -> dict[str, list]:
    """Hold out the tail of every class; shuffle each split's order with a fixed seed."""
    if not 0 < val_fraction < 1:
        raise UserError(f"--val_fraction={val_fraction}: must be in (0, 1), e.g. 0.1.")
    out = {"train": [], "validation": []}
    for k in sorted({label for _, label in files}):
        mine = [f for f in files if f[1] == k]
        n_val = min(len(mine) - 1, max(1, round(val_fraction * len(mine)))) if len(mine) > 1 else 0
        out["train"] += mine[: len(mine) - n_val]
        out["validation"] += mine[len(mine) - n_val:]
    if not out["validation"]:
        raise UserError(f"--val_fraction={val_fraction} holds out no image; every class has one "
                        f"file. Add images, or raise --val_fraction.")
    rng = np.random.default_rng(_ORDER_SEED)
    return {s: [out[s][i] for i in rng.permutation(len(out[s]))] for s in SPLITS}


def colour_mode(path: Path) -> str:
    """'L' for a grey image file, else 'RGB' (reads the header only)."""
    try:
        with Image.open(path) as img:
            return "L" if img.mode == "L" else "RGB"
    except (UnidentifiedImageError, OSError) as e:
        raise UserError(f"{str(path)!r} is not an image PIL can read ({e}). Remove it from the "
                        f"class folders, or convert it to JPEG or PNG.") from None


def encoded(path: Path, channels: int) -> bytes:
    """The bytes to store for one file: the file itself when it is a JPEG or PNG of
    the dataset's colour mode, else the decoded pixels as a PNG (lossless)."""
    data = path.read_bytes()
    img = Image.open(io.BytesIO(data))
    mode = "L" if channels == 1 else "RGB"
    if img.format in ("JPEG", "PNG") and img.mode == mode:
        return data
    buf = io.BytesIO()
    img.convert(mode).save(buf, format="PNG")
    return buf.getvalue()


def write_image_dataset(name: str, data_dir, classes: list[str], splits: dict[str, list],
                        *, extra_metadata: dict | None = None, progress=None) -> dict:
    """Writes the dataset; returns its metadata (counts per split, classes, channels).

    The images have 1 channel when every file is grey, else 3. Files are read twice:
    headers first (to fix the channels and refuse unreadable files before writing),
    then each file as its record is written (`progress(1)` after each).
    """
    modes = {colour_mode(path) for s in SPLITS for path, _ in splits[s]}
    channels = 1 if modes == {"L"} else 3
    metadata = tfds.core.MetadataDict(
        format=FORMAT, num_classes=len(classes), classes=classes, channels=channels,
        num_examples={s: len(splits[s]) for s in SPLITS}, **(extra_metadata or {}))

    def examples(split):
        for path, label in splits[split]:
            yield {"image": encoded(path, channels), "label": label}
            if progress:
                progress(1)

    write_dataset(
        name, data_dir, metadata=metadata,
        description=f"Images of {len(classes)} classes from an image folder, written by "
                    f"meshtrain.data.prepare in {FORMAT}.",
        features=tfds.features.FeaturesDict({
            "image": tfds.features.Image(shape=(None, None, channels)),
            "label": tfds.features.ClassLabel(names=classes)}),
        splits={s: (lambda s=s: examples(s)) for s in SPLITS})
    return dict(metadata)
