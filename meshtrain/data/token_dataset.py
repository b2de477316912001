"""meshtrain's token datasets: TFDS ArrayRecord datasets of pre-tokenized text.

Layout of DATA_DIR/NAME/1.0.0/ (what `tfds.data_source(NAME, data_dir=DATA_DIR)`
reads, with no TensorFlow and no registered builder):
  NAME-{train,validation}.array_record-*   the records
  dataset_info.json, features.json         TFDS's description of them
  metadata.json                            FORMAT, tokenizer summary, token counts
  tokenizer.json                           the tokenizer (load_tokenizer reads it)

A split's token stream is its documents in order, each followed by end of text.
Record k of a split holds stream tokens [k*R, (k+1)*R) in feature "tokens"
(uint16 when the vocabulary fits, else int32; raw bytes, so reading is a
frombuffer), R = record_tokens; only the last record is shorter. A window at any
token offset is then one or two record reads, whatever seq_len is.
"""

import functools
import re
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import tensorflow_datasets as tfds

from meshtrain.data.tfds_writer import dataset_dir, write_dataset  # noqa: F401 (dataset_dir re-exported)
from meshtrain.data.windows import token_dtype
from meshtrain.errors import UserError

FORMAT = "meshtrain.tokens/1"
FEATURE = "tokens"
DEFAULT_RECORD_TOKENS = 4096
# A token shard's bytes: small enough that the shards spread evenly over prepare's workers
# and a worker holds one at a time; grain reads them per process alike.
TOKEN_SHARD_BYTES = 64 << 20
SPLITS = ("train", "validation")

# TFDS dataset names: lower snake case, starting with a letter.
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


def check_name(name) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise UserError(
            f"Dataset name {name!r} is not a valid TFDS name: it must be lower snake case "
            f"starting with a letter (letters a-z, digits, underscores), e.g. 'my_text'.")
    return name


def write_token_dataset(name: str, data_dir, tokenizer,
                        documents: dict[str, Callable[[], Iterable[np.ndarray]]], *,
                        record_tokens: int = DEFAULT_RECORD_TOKENS,
                        extra_metadata: dict | None = None, separator: int | None = None) -> dict:
    """Writes the dataset; returns its metadata.

    Args:
      documents: split -> a function returning that split's token stream as int arrays
        [n_i]: documents each ending in end of text (Corpus.tokens), or runs of them.
      extra_metadata: JSON facts kept in metadata.json (e.g. the source files).
      separator: the id between documents, for their count (default: end of text).

    The records are written by tfds_writer.write_dataset (atomically: an
    interrupted run leaves no dataset that looks finished).
    """
    check_name(name)
    dtype = token_dtype(tokenizer.vocab_size)
    metadata = token_metadata(tokenizer, record_tokens, dtype, extra_metadata)

    def examples(split):
        counts = {"tokens": 0, "documents": 0}
        sep = tokenizer.eot_id if separator is None else separator
        for chunk in _records(documents[split](), record_tokens, counts, sep):
            yield {FEATURE: chunk.astype(dtype)}
        metadata["num_tokens"][split] = counts["tokens"]
        metadata["num_documents"][split] = counts["documents"]

    write_dataset(name, data_dir, metadata=metadata, description=description(tokenizer),
                  features=token_features(dtype), splits={split: (lambda split=split: examples(split))
                                                          for split in documents})
    return dict(metadata)


@functools.lru_cache(maxsize=8)
def record_header(nbytes: int) -> bytes:
    """The bytes before `nbytes` of ids in a record, as TFDS's token_features serializes it
    (the same bytes, tested): the raw ids are the innermost, last field of the tf.Example,
    so a record is this header, built once per length from TFDS's protos, then the ids. A
    proto per record cost as much as writing the shards; every record but a split's last
    has one length."""
    from tensorflow_datasets.proto import tf_example_pb2, tf_feature_pb2
    fill = b"\0" * nbytes
    raw = tf_feature_pb2.Feature(bytes_list=tf_feature_pb2.BytesList(value=[fill]))
    whole = tf_example_pb2.Example(features=tf_feature_pb2.Features(feature={FEATURE: raw})).SerializeToString()
    assert whole.endswith(fill), "the ids are no longer the tf.Example's last field"
    return whole[:len(whole) - nbytes]


def token_features(dtype):
    return tfds.features.FeaturesDict({FEATURE: tfds.features.Tensor(
        shape=(None,), dtype=dtype, encoding=tfds.features.Encoding.BYTES)})


def _records(docs: Iterable[np.ndarray], size: int, counts: dict, eot: int):
    """Chunks of exactly `size` tokens of the concatenated docs, then the rest. A document
    is a run of ids between ends of text: a pre-tokenized stream comes in runs of documents,
    its end of text after each (nanoGPT, Megatron) or before each (llm.c), so counting the
    ends of text would count one too many or too few per split."""
    buf: list[np.ndarray] = []
    held, after_eot = 0, True  # the stream starts as after an end of text
    for doc in docs:
        counts["tokens"] += len(doc)
        if len(doc):
            ends = doc == eot
            counts["documents"] += int(np.count_nonzero(~ends & np.concatenate([[after_eot], ends[:-1]])))
            after_eot = bool(ends[-1])
        buf.append(doc)
        held += len(doc)
        if held >= size:
            flat = np.concatenate(buf)
            whole = len(flat) // size * size
            yield from flat[:whole].reshape(-1, size)
            buf, held = [flat[whole:]], len(flat) - whole
    if held:
        yield np.concatenate(buf)


def token_metadata(tokenizer, record_tokens: int, dtype, extra: dict | None):
    return _TokenMetadata(
        tokenizer, format=FORMAT, feature=FEATURE, record_tokens=record_tokens,
        tokenizer={"name": tokenizer.name, "describe": tokenizer.describe()},
        vocab_size=tokenizer.vocab_size, eot_id=tokenizer.eot_id, dtype=np.dtype(dtype).name,
        num_tokens={}, num_documents={}, **(extra or {}))


def description(tokenizer) -> str:
    return f"Token ids of local text ({tokenizer.describe()}), written by meshtrain.data.prepare in {FORMAT}."


class _TokenMetadata(tfds.core.MetadataDict):
    """tfds metadata that also writes tokenizer.json beside metadata.json.

    TFDS saves metadata after every split is generated, into the directory it
    renames at the end, so the token counts are filled in and the tokenizer
    commits atomically with the records.
    """

    def __init__(self, tokenizer_object, **kw):
        super().__init__(**kw)
        self._tokenizer = tokenizer_object

    def save_metadata(self, data_dir):
        super().save_metadata(data_dir)
        self._tokenizer.save(Path(str(data_dir)) / "tokenizer.json")
