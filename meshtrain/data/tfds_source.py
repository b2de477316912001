"""data.kind = 'tfds': TFDS datasets read through `tfds.data_source` (ArrayRecord).

Two kinds of dataset are read:
  * meshtrain token datasets (meshtrain/data/token_dataset.py, written by
    `python -m meshtrain.data.prepare`): the tokenizer comes with the dataset and
    windows are read straight from the records.
  * any other prepared ArrayRecord dataset (lm1b, c4, ...): records are documents
    whose `data.feature` is text (tokenized with `data.tokenizer`) or token ids.
    The first run tokenizes the two splits once, with a progress bar, into a
    meshtrain token dataset in `data.cache_dir` (default: data.data_dir) named
    NAME__FEATURE_SPLIT_EVALSPLIT_TOKENIZER (meshtrain/data/catalog.py: every process
    tokenizes a share of the records, each with data.workers worker processes); later
    runs read that.

Nothing here downloads: a catalog dataset must already be prepared as
ArrayRecord under data.data_dir (TensorFlow is needed only for that step).
"""

import hashlib
import math
import os
import re
from pathlib import Path

import tensorflow_datasets as tfds

from meshtrain.data import catalog, token_dataset
from meshtrain.data.source import DataSource
from meshtrain.data.tokenizers import check_tokenizer_spec, load_tokenizer
from meshtrain.data.windows import RecordStream, stream_source
from meshtrain.errors import UserError, warn


def make_tfds_source(data_cfg, *, seq_len: int, seed: int) -> DataSource:
    name, data_dir = data_cfg.get("name"), data_cfg.get("data_dir") or None
    split, eval_split = data_cfg.get("split") or "train", data_cfg.get("eval_split") or "validation"
    builder = open_builder(name, data_dir)
    meta = dict(builder.info.metadata or {})
    if meta.get("format") != token_dataset.FORMAT:
        builder = _converted(builder, data_cfg, split, eval_split)
        meta, split, eval_split = dict(builder.info.metadata), "train", "validation"
    check_splits(builder, (split, eval_split))
    for s in (split, eval_split):
        if not int((meta.get("num_tokens") or {}).get(s) or 0):
            raise UserError(
                f"TFDS dataset {builder.name!r} split {s!r} holds no tokens (metadata.json in "
                f"{str(builder.data_dir)!r}), so there is nothing to {'train on' if s == split else 'evaluate'}. "
                f"Prepare it again from inputs whose {s} part holds documents (prepare --overwrite).")
    tok = load_tokenizer(Path(str(builder.data_dir)) / "tokenizer.json")
    asked = data_cfg.get("tokenizer") or "byte"
    if asked not in ("byte", tok.name) and "source" in meta and "tfds" not in meta["source"]:
        # 'byte' is the default, so only a tokenizer set on purpose is worth a word.
        warn(f"data.tokenizer={asked!r} is not used: TFDS dataset {builder.name!r} carries its "
             f"own tokenizer ({tok.describe()}).")
    sources = builder.as_data_source()
    train, val = (_stream(sources[s], meta, s, builder) for s in (split, eval_split))
    info = {"kind": "tfds", "name": builder.name, "data_dir": str(builder.data_dir),
            "splits": [split, eval_split], "tokenizer": tok.name,
            "vocab_size": tok.vocab_size, "eot_id": tok.eot_id,
            "record_tokens": meta["record_tokens"]}
    return stream_source(train, val, seq_len=seq_len, seed=seed,
                         random_offsets=bool(data_cfg.get("random_offsets", False)),
                         vocab_size=tok.vocab_size, info=info, tokenizer=tok,
                         where=f"TFDS dataset {builder.name!r}")


def open_builder(name, data_dir, input_flag: str = "--input=..."):
    """The TFDS builder of a prepared dataset; a UserError if it is not there.

    `input_flag` is the prepare flag the error suggests (image datasets: --images=DIR).
    """
    if not name:
        raise UserError(
            "data.kind is 'tfds' but data.name is not set. Set data.name to a TFDS dataset "
            "(one written by `python -m meshtrain.data.prepare --name=NAME`, or a catalog "
            "dataset such as lm1b prepared as ArrayRecord) and data.data_dir to its directory.")
    where = data_dir or "the default TFDS data directory (~/tensorflow_datasets)"
    try:
        builder = tfds.builder(name, data_dir=data_dir)
    except Exception as e:  # tfds raises several types; all mean "not found" here
        raise UserError(
            f"TFDS dataset {name!r} was not found in {where}: {_first_line(e)}. Datasets "
            f"there: {_listing(data_dir)}. Check data.name and data.data_dir, or create it "
            f"with `python -m meshtrain.data.prepare --name={name} --data_dir=DIR "
            f"{input_flag}`.") from None
    files = list(Path(str(builder.data_dir)).glob("*.array_record*")) if Path(
        str(builder.data_dir)).is_dir() else []
    if not files:
        raise UserError(
            f"TFDS dataset {name!r} is not prepared as ArrayRecord in {where} (looked in "
            f"{str(builder.data_dir)!r}). meshtrain reads prepared ArrayRecord data and never "
            f"downloads. Prepare it where TensorFlow and network are available (`tfds build "
            f"{name} --file_format=array_record --data_dir=DIR`) and copy DIR here, or make "
            f"your own with `python -m meshtrain.data.prepare`.")
    return builder


def check_splits(builder, splits) -> None:
    have = list(builder.info.splits.keys())
    for s in splits:
        if s not in have:
            raise UserError(
                f"TFDS dataset {builder.name!r} has no split {s!r}; its splits are {have}. "
                f"Set data.split (training) and data.eval_split (held out) to two of them.")


def _stream(source, meta: dict, split: str, builder) -> RecordStream:
    n, r = int(meta["num_tokens"][split]), int(meta["record_tokens"])
    # Records must be in stream order; the short last record is a cheap witness.
    if len(source) != math.ceil(n / r) or len(source[len(source) - 1][token_dataset.FEATURE]) != \
            n - (len(source) - 1) * r:
        raise UserError(
            f"TFDS dataset {builder.name!r} split {split!r} is damaged: metadata.json says "
            f"{n} tokens in records of {r} ({math.ceil(n / r)} records, in stream order), but "
            f"there are {len(source)}, or the last is not the short one. Prepare it again "
            f"(prepare --overwrite).")
    return RecordStream(source, token_dataset.FEATURE, r, n)


# --- other TFDS datasets: tokenized once into a token dataset ---------------------

def _converted(builder, data_cfg, split: str, eval_split: str):
    """The token dataset made from `builder`'s documents, written on first use."""
    check_splits(builder, (split, eval_split))
    feature = data_cfg.get("feature") or "text"
    features = builder.info.features
    if feature not in features.keys():
        raise UserError(
            f"TFDS dataset {builder.name!r} has no feature {feature!r}; its features are "
            f"{sorted(features.keys())}. Set data.feature to the text (or token id) field.")
    spec = check_tokenizer_spec(data_cfg.get("tokenizer") or "byte")
    if spec == "char":
        raise UserError(
            f"The char tokenizer builds its vocabulary from a whole local corpus, so it "
            f"cannot tokenize TFDS dataset {builder.name!r} on the fly. Use data.tokenizer "
            f"= byte, bpe:PATH or gpt2.")
    name = _cache_name(data_cfg.get("name"), feature, split, eval_split, spec)
    cache = data_cfg.get("cache_dir") or data_cfg.get("data_dir") or os.environ.get(
        "TFDS_DATA_DIR", "~/tensorflow_datasets")
    if not token_dataset.dataset_dir(cache, name).exists():
        catalog.convert(builder, feature, {"train": split, "validation": eval_split}, spec, name, cache,
                        max(int(data_cfg.get("workers") or 0), 1))
    return open_builder(name, cache)


def _cache_name(dataset: str, feature, split, eval_split, spec) -> str:
    """A TFDS name for the tokenized copy; 'c4/en:3.1.0' and its config stay distinct."""
    tag = spec
    if spec.startswith("bpe:"):
        tag = "bpe_" + hashlib.sha1(Path(spec[4:]).read_bytes()).hexdigest()[:10] if Path(
            spec[4:]).is_file() else "bpe"
    raw = f"{dataset}__{feature}_{split}_{eval_split}_{tag}".lower()
    return re.sub(r"[^a-z0-9_]", "_", raw)


def _listing(data_dir) -> str:
    root = Path(data_dir).expanduser() if data_dir else Path("~/tensorflow_datasets").expanduser()
    names = sorted(p.name for p in root.iterdir() if p.is_dir() and p.name != "downloads") \
        if root.is_dir() else []
    return ", ".join(names) if names else f"none ({str(root)!r} is empty or missing)"


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
