"""Write a TFDS ArrayRecord dataset from Python examples, offline.

No TensorFlow and no registered builder: a `GeneratorBasedBuilder` is made on the
fly for one dataset, so `tfds.data_source(NAME, data_dir=DATA_DIR)` (and
`tfds.builder`) read the result anywhere. The token datasets
(meshtrain/data/token_dataset.py) and the image datasets
(meshtrain/data/image_dataset.py) are both written here.
"""

from pathlib import Path
from typing import Callable, Iterable

import tensorflow_datasets as tfds

VERSION = "1.0.0"


def dataset_dir(data_dir, name: str) -> Path:
    return Path(data_dir).expanduser() / name / VERSION


def write_dataset(name: str, data_dir, *, features, description: str, metadata,
                  splits: dict[str, Callable[[], Iterable[dict]]]) -> None:
    """Writes DATA_DIR/NAME/VERSION with one ArrayRecord split per entry of `splits`.

    Args:
      features: a `tfds.features.FeaturesDict` describing each example.
      metadata: a `tfds.core.MetadataDict`, saved as metadata.json; a split's
        generator may fill it in as it goes (it is saved after every split).
      splits: split name -> a function returning that split's examples in order;
        record k of the split is the k-th example (keys are kept, not hashed).

    TFDS writes into an `incomplete.*` directory and renames it when every split
    is done, so an interrupted run leaves no dataset that looks finished.
    """

    class Dataset(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        VERSION = tfds.core.Version(globals()["VERSION"])
        # TFDS looks for checksum files beside the builder's module; there are none
        # (nothing is downloaded), and meshtrain is a namespace package it cannot walk.
        code_path = None

        # TFDS prints "Downloading and preparing ..." lines; nothing is downloaded,
        # and prepare prints its own progress and summary.
        def _log_download_bytes(self):
            pass

        def _log_download_done(self):
            pass

        def _info(self):
            return tfds.core.DatasetInfo(
                builder=self,
                # Records stay in the order given (a token stream's order, or an image
                # order the writer chose): keys are written as given instead of hashed.
                disable_shuffling=True, description=description, features=features,
                metadata=metadata)

        def _split_generators(self, dl_manager):
            return {split: self._generate_examples(split) for split in splits}

        def _generate_examples(self, split):
            yield from enumerate(splits[split]())

    Dataset.name = name
    tfds.disable_progress_bar()  # the caller shows one progress bar over the input
    Dataset(data_dir=str(Path(data_dir).expanduser()),
            file_format="array_record").download_and_prepare()
