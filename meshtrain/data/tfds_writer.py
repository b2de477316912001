"""Write a TFDS ArrayRecord dataset from Python examples, offline.

No TensorFlow and no registered builder: a `GeneratorBasedBuilder` is made on the
fly for one dataset's description, so `tfds.data_source(NAME, data_dir=DATA_DIR)` (and
`tfds.builder`) read the result anywhere; the records are written here, as they come. The token datasets
(meshtrain/data/token_dataset.py) and the image datasets
(meshtrain/data/image_dataset.py) are both written here. TFDS is imported where it is
used: prepare's workers write shards with `write_shard` and need none of it (0.55 s each).
"""

import os
import shutil
import uuid
from pathlib import Path
from typing import Callable, Iterable


VERSION = "1.0.0"
SHARD_BYTES = 256 << 20  # a shard's records, serialized: many shards for grain to spread


def dataset_dir(data_dir, name: str) -> Path:
    return Path(data_dir).expanduser() / name / VERSION


def write_dataset(name: str, data_dir, *, features, description: str, metadata,
                  splits: dict[str, Callable[[], Iterable[dict]]], shard_bytes: int = SHARD_BYTES) -> None:
    """Writes DATA_DIR/NAME/VERSION with the ArrayRecord shards of each entry of `splits`.

    Args:
      features: a `tfds.features.FeaturesDict` describing each example.
      metadata: a `tfds.core.MetadataDict`, saved as metadata.json; a split's
        generator may fill it in as it goes (it is saved after every split is written).
      splits: split name -> a function returning that split's examples in order;
        record k of the split is the k-th example, a shard about `shard_bytes` long.

    The examples are serialized by TFDS's features and written by array_record as they
    come, with the dataset's description (dataset_info.json, features.json) from TFDS's
    DatasetInfo, so `tfds.data_source` reads the result. Not TFDS's own generation, which
    holds up to 1 GB of records in memory and spills the rest through TensorFlow's file
    API (TensorFlow is not installed). All is written into `incomplete.*` and renamed
    at the end, so an interrupted run leaves no dataset that looks finished.
    """
    with Incomplete(name, data_dir, features, description, metadata) as out:
        out.finish([_write_split(out, split, examples(), shard_bytes) for split, examples in splits.items()])


class Incomplete:
    """A dataset being written: `root` (DATA_DIR/NAME/incomplete.*) takes the shards
    (`shard_path`), `finish(split_infos)` writes TFDS's description and renames it
    DATA_DIR/NAME/VERSION; leaving the block without `finish` removes it."""

    def __init__(self, name: str, data_dir, features, description: str, metadata):
        self.name, self.features = name, features
        self.final = dataset_dir(data_dir, name)
        self.final.parent.mkdir(parents=True, exist_ok=True)
        for left in self.final.parent.glob("incomplete.*"):  # a killed write's: nothing in it is kept
            shutil.rmtree(left, ignore_errors=True)
        self.root = self.final.parent / f"incomplete.{VERSION}.{uuid.uuid4().hex}"
        self.info = _builder(name, description, features, metadata)(
            data_dir=str(Path(data_dir).expanduser()), file_format="array_record").info

    def __enter__(self):
        self.root.mkdir()
        return self

    def shard_path(self, split: str, shard: int, shards: int | None) -> Path:
        suffix = f"-of-{shards:05d}" if shards is not None else ""
        return self.root / f"{self.name}-{split}.array_record-{shard:05d}{suffix}"

    def split_info(self, split: str, shard_lengths: list[int], nbytes: int):
        import tensorflow_datasets as tfds
        template = tfds.core.ShardedFileTemplate(data_dir=self.root, dataset_name=self.name, split=split,
                                                 filetype_suffix="array_record")
        return tfds.core.SplitInfo(name=split, shard_lengths=shard_lengths, num_bytes=nbytes,
                                   filename_template=template)

    def finish(self, split_infos, replace: bool = False) -> None:
        """replace: a dataset already at the final path goes (--overwrite), just before the rename."""
        import tensorflow_datasets as tfds
        self.info.set_splits(tfds.core.SplitDict(split_infos))
        self.info.write_to_directory(self.root)
        if replace and self.final.exists():
            shutil.rmtree(self.final)
        os.rename(self.root, self.final)

    def __exit__(self, *exc):
        shutil.rmtree(self.root, ignore_errors=True)


def _builder(name: str, description: str, features, metadata):
    """A builder class for one dataset's description (never generated: the shards are
    written here)."""
    import tensorflow_datasets as tfds

    class _LocalInfo(tfds.core.DatasetInfo):
        def initialize_from_bucket(self) -> None:
            # TFDS looks for a registered dataset's published statistics here, in a new
            # temporary directory it never removes (one left in /tmp per dataset written);
            # ours is described by the writer, never published.
            pass

    class Dataset(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        VERSION = tfds.core.Version(globals()["VERSION"])
        # TFDS looks for checksum files beside the builder's module; there are none
        # (nothing is downloaded), and meshtrain is a namespace package it cannot walk.
        code_path = None

        def _info(self):
            return _LocalInfo(
                builder=self,
                # Records stay in the order given (a token stream's order, or an image
                # order the writer chose).
                disable_shuffling=True, description=description, features=features,
                metadata=metadata)

        def _split_generators(self, dl_manager):
            raise NotImplementedError  # written by Incomplete, never generated

        def _generate_examples(self, split):
            raise NotImplementedError

    Dataset.name = name
    return Dataset


def write_shard(path: Path, records: Iterable[bytes], options: str = "group_size:1") -> tuple[int, int]:
    """Serialized records into one ArrayRecord file (group_size 1, as TFDS writes them:
    one read a record); -> (records, bytes)."""
    from array_record.python.array_record_module import ArrayRecordWriter
    writer, n, nbytes = ArrayRecordWriter(str(path), options), 0, 0
    try:
        for data in records:
            writer.write(data)
            n, nbytes = n + 1, nbytes + len(data)
    finally:
        writer.close()
    return n, nbytes


def _write_split(out: Incomplete, split: str, examples, shard_bytes: int):
    """One split's shards as the examples come, each closed past `shard_bytes` and renamed
    `-of-COUNT` once the count is known; -> its tfds SplitInfo."""
    lengths, nbytes, paths = [], 0, []
    examples = iter(examples)
    pending = [next(examples, None)]
    while pending[0] is not None:
        paths.append(out.shard_path(split, len(paths), None))
        size = [0]

        def shard():
            while pending[0] is not None and size[0] < shard_bytes:
                data = out.features.serialize_example(pending[0])
                size[0] += len(data)
                yield data
                pending[0] = next(examples, None)
        n, b = write_shard(paths[-1], shard())
        lengths.append(n)
        nbytes += b
    for path in paths:
        path.rename(f"{path}-of-{len(paths):05d}")
    return out.split_info(split, lengths, nbytes)
