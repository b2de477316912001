"""Training data: one entry point, `make_source`, for every kind of data.

Kinds:
  synthetic: a Markov chain with a known entropy rate (`info["best_loss"]`), so a
    loss curve has a floor to be judged against. Vocabulary from the model config.
  text: local text files (a path or glob), tokenized in memory at startup.
  tfds: a TFDS ArrayRecord dataset: one written by `python -m meshtrain.data.prepare`
    (tokens stored), or a catalog one such as lm1b (tokenized once, then cached).
For text and tfds the tokenizer decides the vocabulary (`source.vocab_size`).

An image classifier (task "classify") reads images and labels instead:
  synthetic: class patterns with label noise, a known best accuracy
    (`info["best_accuracy"]`); classes from the model config's vocab_size.
  images: data.name=digits (scikit-learn's bundled digits, no download), or a TFDS
    ArrayRecord image dataset (cifar10, imagenet2012, `prepare --images=DIR`).
"""

from __future__ import annotations

import numbers

from meshtrain.data.tokenizers import TOKENIZERS, load_tokenizer
from meshtrain.errors import UserError

__all__ = ["DataSource", "KINDS", "TOKENIZERS", "load_tokenizer", "make_source"]

KINDS = ("synthetic", "text", "tfds", "images")
TASKS = ("lm", "classify")

# The synthetic chain's vocabulary when the model config leaves it at -1 (or None).
DEFAULT_SYNTHETIC_VOCAB = 256
# Synthetic images' classes when the model config leaves vocab_size at -1 (or None).
DEFAULT_SYNTHETIC_CLASSES = 10


def make_source(data_cfg, *, vocab_size: int, seq_len: int, seed: int, task: str = "lm",
                image_size: int = 0, image_channels: int = 3):
    """-> the DataSource (meshtrain/data/source.py) that `data_cfg.kind` names, for the model's task.

    Args:
      data_cfg: ConfigDict with kind, path, tokenizer, name, data_dir, split,
        eval_split, feature, cache_dir, val_fraction, random_offsets (only the keys
        of the chosen kind are read).
      vocab_size: the model config's vocabulary; the synthetic chain's size (-1
        or None means 256). Ignored by text sources, whose tokenizer decides.
      seq_len: tokens per training example; windows hold seq_len + 1 tokens.
      seed: non-negative; fixes the synthetic chain and its samples, and the
        order of text windows.
      task: "lm" (token windows) or "classify" (an ImageSource: batches
        {"images": uint8 [b, S, S, C], "labels": int32 [b]}; vocab_size is then the
        synthetic images' number of classes, seq_len is not read).
      image_size, image_channels: S and C of a classifier's input images.
    """
    kind = data_cfg.get("kind")
    if task == "classify":
        _check_reading(data_cfg)
        return _image_source(data_cfg, kind, vocab_size, seed, image_size, image_channels)
    if task != "lm":
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    _check_seq_len_and_seed(seq_len, seed)
    _check_reading(data_cfg)
    if kind == "images":
        raise UserError(
            "data.kind=images holds images and labels, but the model is a language model "
            "(it reads token windows). Set data.kind to synthetic, text or tfds, or train an "
            "image model (model.name=vgg or resnet).")
    if kind == "synthetic":
        vocab = DEFAULT_SYNTHETIC_VOCAB if vocab_size in (-1, None) else vocab_size
        _check_synthetic_vocab(vocab)
        from meshtrain.data.synthetic import make_synthetic_source
        return make_synthetic_source(vocab_size=vocab, seq_len=seq_len, seed=seed)
    if kind == "text":
        from meshtrain.data.text import make_text_source
        return make_text_source(
            data_cfg.get("path"), tokenizer=data_cfg.get("tokenizer", "byte"),
            val_fraction=data_cfg.get("val_fraction", 0.05), seq_len=seq_len, seed=seed,
            random_offsets=bool(data_cfg.get("random_offsets", False)))
    if kind == "tfds":
        from meshtrain.data.tfds_source import make_tfds_source  # lazy: imports TFDS
        return make_tfds_source(data_cfg, seq_len=seq_len, seed=seed)
    raise UserError(
        f"Unknown data.kind {kind!r}. Known kinds: {', '.join(KINDS)} ('synthetic' "
        f"is a Markov chain with a known best loss; 'text' reads data.path; 'tfds' reads "
        f"data.name from data.data_dir; 'images' is for image models). Set data.kind to one "
        f"of them.")


def _image_source(data_cfg, kind, classes, seed, image_size, channels):
    _check_seed(seed)
    if not _is_int(image_size) or image_size < 1:
        raise UserError(
            f"An image classifier needs model.image_size, the height and width of its input "
            f"images, as a positive integer; got {image_size!r}. Set model.image_size (e.g. 32).")
    if channels not in (1, 3):
        raise UserError(f"Images have 1 (grey) or 3 (RGB) channels; the model asks for "
                        f"{channels!r}. Set the model's image_channels to 1 or 3.")
    from meshtrain.data.image_source import check_augment
    check_augment(data_cfg.get("augment", "auto"), data_cfg.get("crop_scale", 0.08))
    if kind == "synthetic":
        classes = DEFAULT_SYNTHETIC_CLASSES if classes in (-1, None) else classes
        if not _is_int(classes) or classes < 2:
            raise UserError(
                f"Synthetic images need at least 2 classes, but the model config's vocab_size "
                f"(its classes) is {classes!r}. Set model.vocab_size to an integer >= 2.")
        from meshtrain.data.synthetic_images import make_synthetic_image_source
        return make_synthetic_image_source(num_classes=classes, image_size=image_size,
                                           channels=channels, seed=seed)
    if kind == "images":
        name = data_cfg.get("name")
        if not name:
            raise UserError(
                "data.kind is 'images' but data.name is not set. Set data.name=digits (bundled "
                "with scikit-learn, no download), or to a TFDS image dataset (cifar10, "
                "imagenet2012, or one written by `python -m meshtrain.data.prepare --images=DIR`) "
                "and data.data_dir to its directory.")
        if name == "digits":
            from meshtrain.data.image_source import make_digits_source
            return make_digits_source(data_cfg, image_size=image_size, channels=channels,
                                      seed=seed)
        from meshtrain.data.image_records import make_tfds_image_source  # lazy: imports TFDS
        return make_tfds_image_source(data_cfg, image_size=image_size, channels=channels,
                                      seed=seed)
    if kind in ("text", "tfds"):
        raise UserError(
            f"data.kind={kind} gives token windows for a language model, but the model "
            f"classifies images. Set data.kind=images with data.name=digits (no download), "
            f"cifar10 or imagenet2012 (prepared under data.data_dir), or data.kind=synthetic.")
    raise UserError(
        f"Unknown data.kind {kind!r}. An image classifier reads data.kind=synthetic (patterns "
        f"with a known best accuracy) or images (data.name from data.data_dir, or digits).")


def _check_reading(d) -> None:
    workers, prefetch = d.get("workers", 0), d.get("prefetch", 0)
    if workers < 0 or prefetch < 0:
        raise UserError(
            f"data.workers={workers}, data.prefetch={prefetch}: both must be >= 0 (workers "
            f"is grain worker processes, 0 reads in this process; prefetch is batches read "
            f"ahead, 0 reads on demand).")


def _check_synthetic_vocab(vocab: int) -> None:
    if not _is_int(vocab) or vocab < 2:
        raise UserError(
            f"Synthetic data needs a vocabulary of at least 2 symbols, but the model "
            f"config's vocab_size is {vocab!r}. Set vocab_size to an integer >= 2, or "
            f"to -1 for the default of {DEFAULT_SYNTHETIC_VOCAB}.")


def _check_seq_len_and_seed(seq_len: int, seed: int) -> None:
    if not _is_int(seq_len) or seq_len < 1:
        raise UserError(
            f"seq_len must be a positive integer (tokens per training example); got "
            f"{seq_len!r}. Set it to, for example, 256.")
    _check_seed(seed)


def _check_seed(seed: int) -> None:
    if not _is_int(seed) or not 0 <= seed < 2**32:
        raise UserError(
            f"The seed must be an integer in [0, 2**32) because it seeds the data "
            f"shuffle; got {seed!r}. Set it to a non-negative integer such as 0.")


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def __getattr__(name: str):
    # The sources import grain (2 s): prepare's spawned workers import this package for
    # its readers alone, so the sources load when a run asks for one.
    if name == "DataSource":
        from meshtrain.data.source import DataSource
        return DataSource
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
