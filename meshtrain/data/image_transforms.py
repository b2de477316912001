"""Image transforms: decode, random-resized crop and flip for training, resize and
centre crop for eval; uint8 out at the model's size.

Every transform is one crop box per image (x0, y0, x1, y1 in the image's pixels,
floats) resized to size x size with PIL's antialiased bilinear filter: PIL crops
and resizes in one step (`Image.resize(box=...)`), and a JPEG is decoded at the
smallest power-of-two reduction that still gives the box `size` pixels
(`Image.draft`): 1.5x faster for 1600x1200 photos cropped to 224 px.

Augmentation (`data.augment`):
  crop:  Inception's random-resized crop (Szegedy et al. 2015, as torchvision's
         RandomResizedCrop): area fraction uniform in [crop_scale, 1], aspect
         ratio log-uniform in [3/4, 4/3], position uniform; 10 tries, then the
         largest centred box of an allowed ratio.
  flip:  horizontal, with probability 1/2.
  eval (and training without crop): the centred square of side r * min(h, w),
         r = EVAL_CROP (0.875, ImageNet's resize-256-crop-224) when training
         crops, else 1 (the whole image, as small datasets are used).

The random numbers of the example at stream position p are splitmix64 draws of
(seed, p, column), so a resumed run, any batch size and any process count read
the same pixels.
"""

import io
import math

import numpy as np
from PIL import Image

from meshtrain.data.windows import splitmix64

AUGMENTS = ("", "flip", "crop", "crop_flip")
# Eval keeps the centre 87.5% of the shorter side when training crops (ImageNet's
# resize to 256, centre 224: 224 / 256 = 0.875).
EVAL_CROP = 0.875
CROP_RATIO = (3 / 4, 4 / 3)
CROP_TRIES = 10
# Uniform columns per example: CROP_TRIES areas, CROP_TRIES ratios, x, y, flip.
_COLUMNS = 2 * CROP_TRIES + 3
_TAG = 0x1A6E  # separates these draws from other splitmix64 users of the same seed


def mode_of(channels: int) -> str:
    """PIL's mode for `channels` colour channels (1: grey, 3: RGB)."""
    return {1: "L", 3: "RGB"}[channels]


def uniforms(seed: int, positions: np.ndarray, columns: int = _COLUMNS) -> np.ndarray:
    """Counter-based uniforms in [0, 1); [rows] int positions -> [rows, columns] float64."""
    pos = np.asarray(positions, np.uint64)[:, None]
    col = np.arange(columns, dtype=np.uint64)[None, :]
    with np.errstate(over="ignore"):
        key = splitmix64(splitmix64(np.uint64(seed) ^ np.uint64(_TAG)) ^ pos)
        z = splitmix64(key + col)
    return (z >> np.uint64(11)).astype(np.float64) * 2.0**-53  # 53 random bits


def crop_boxes(h: np.ndarray, w: np.ndarray, u: np.ndarray, crop_scale: float) -> np.ndarray:
    """Inception random-resized crop boxes; h, w [rows], u [rows, columns] -> [rows, 4]."""
    h, w = np.asarray(h, np.float64), np.asarray(w, np.float64)
    k = CROP_TRIES
    area = (h * w)[:, None] * (crop_scale + (1 - crop_scale) * u[:, :k])
    lo, hi = np.log(CROP_RATIO[0]), np.log(CROP_RATIO[1])
    ratio = np.exp(lo + (hi - lo) * u[:, k: 2 * k])
    cw, ch = np.sqrt(area * ratio), np.sqrt(area / ratio)  # [rows, tries]
    fits = (cw <= w[:, None]) & (ch <= h[:, None])
    first = fits.argmax(axis=1)  # the first try that fits (0 if none does)
    rows = np.arange(len(h))
    cw, ch = cw[rows, first], ch[rows, first]
    # No try fits: the whole image, trimmed to the nearest allowed aspect ratio.
    fw = np.where(w / h > CROP_RATIO[1], h * CROP_RATIO[1], w)
    fh = np.where(w / h < CROP_RATIO[0], w / CROP_RATIO[0], h)
    ok = fits.any(axis=1)
    cw, ch = np.where(ok, cw, fw), np.where(ok, ch, fh)
    x0 = u[:, 2 * k] * (w - cw)
    y0 = u[:, 2 * k + 1] * (h - ch)
    return np.stack([x0, y0, x0 + cw, y0 + ch], axis=1)


def centre_boxes(h: np.ndarray, w: np.ndarray, ratio: float) -> np.ndarray:
    """The centred square of side ratio * min(h, w); [rows] -> [rows, 4]."""
    h, w = np.asarray(h, np.float64), np.asarray(w, np.float64)
    side = ratio * np.minimum(h, w)
    x0, y0 = (w - side) / 2, (h - side) / 2
    return np.stack([x0, y0, x0 + side, y0 + side], axis=1)


def flips(u: np.ndarray) -> np.ndarray:
    """Which examples are flipped; [rows, columns] -> [rows] bool."""
    return u[:, 2 * CROP_TRIES + 2] < 0.5


def boxes_for(h, w, *, train: bool, augment: str, crop_scale: float,
              seed: int = 0, positions=None) -> tuple[np.ndarray, np.ndarray]:
    """Crop boxes [rows, 4] and flips [rows] bool of a batch (see the module docstring).

    Training draws from (seed, position); eval (train=False) draws nothing.
    """
    h, w = np.asarray(h), np.asarray(w)
    no_flip = np.zeros(len(h), bool)
    if not train:
        return centre_boxes(h, w, EVAL_CROP if "crop" in augment else 1.0), no_flip
    u = uniforms(seed, positions)
    boxes = crop_boxes(h, w, u, crop_scale) if "crop" in augment else centre_boxes(h, w, 1.0)
    return boxes, flips(u) if "flip" in augment else no_flip


def open_encoded(data: bytes) -> Image.Image:
    """A lazily decoded image (PIL reads the header now, the pixels on first use)."""
    return Image.open(io.BytesIO(data))


def render(img: Image.Image, box, size: int, channels: int) -> np.ndarray:
    """Crop `box` of `img`, resize to size x size; -> uint8 [size, size, channels]."""
    mode = mode_of(channels)
    box = np.asarray(box, np.float64)
    if img.mode == mode and img.size == (size, size) and np.array_equal(box, [0, 0, size, size]):
        return np.asarray(img).reshape(size, size, channels)  # nothing to crop or resize
    if img.format == "JPEG":
        # Decode at a reduced scale as long as the box keeps >= size pixels each way.
        w0, h0 = img.size
        bw, bh = box[2] - box[0], box[3] - box[1]
        img.draft(mode, (math.ceil(w0 * size / bw), math.ceil(h0 * size / bh)))
        box = box * np.array([img.size[0] / w0, img.size[1] / h0] * 2)
    if img.mode != mode:
        img = img.convert(mode)
    out = np.asarray(img.resize((size, size), Image.BILINEAR, box=tuple(box)))
    return out.reshape(size, size, channels)


def render_batch(images: list[Image.Image], boxes: np.ndarray, flip: np.ndarray,
                 size: int, channels: int) -> np.ndarray:
    """Each image cropped, resized and flipped; -> uint8 [rows, size, size, channels]."""
    out = np.empty((len(images), size, size, channels), np.uint8)
    for row, (img, box) in enumerate(zip(images, boxes)):
        out[row] = render(img, box, size, channels)
    return flip_rows(out, flip)


def flip_rows(batch: np.ndarray, flip: np.ndarray) -> np.ndarray:
    """Mirror the rows where flip is True along width; [rows, H, W, C] -> same."""
    return np.where(flip[:, None, None, None], batch[:, :, ::-1], batch)


def from_array(image: np.ndarray) -> Image.Image:
    """uint8 [H, W, C] (C = 1 or 3) -> a PIL image of mode L or RGB."""
    return Image.fromarray(np.ascontiguousarray(image[..., 0] if image.shape[-1] == 1 else image))
