"""A TFDS catalog dataset (lm1b, c4, ...) made a meshtrain token dataset once, by every
process of the run and its data workers together (meshtrain/data/tfds_source.py reads it).

The two splits' records are cut into units of consecutive records, as `meshtrain prepare`
cuts its inputs (meshtrain/data/tokenize_pool.py), in the same work directory layout:

    CACHE/.NAME.prepare/   plan.json, tokenizer.json, unit-K.tokens / .ends / .done

Process p of P tokenizes units p, p + P, p + 2P, ..., each on one of its `data.workers`
worker processes (1: in the process). All processes wait for each other (a barrier over
JAX's coordination service); process 0 then writes the shards from the units' files with
its workers, and the others wait for the dataset. A killed conversion rerun keeps the
finished units, and the dataset is the same whatever the process and worker counts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np

from meshtrain.data import token_dataset, token_shards, tokenize_pool
from meshtrain.data.corpus import Unit
from meshtrain.errors import UserError
from meshtrain.progress import Progress

RECORDS_PER_GROUP = 512  # records read at once: one batched ArrayRecord read


class CatalogRecords:
    """A catalog dataset's records as prepare's workers read them: unit.where is
    (their split, first record, end record). Picklable: a worker opens the prepared
    dataset from its directory (`builder_dir`: DATA_DIR/NAME/VERSION)."""

    def __init__(self, builder_dir: str, feature: str, sources=None):
        self.builder_dir, self.feature, self._sources = builder_dir, feature, sources

    def __getstate__(self):
        return {**self.__dict__, "_sources": None}

    def source(self, split: str):
        if self._sources is None:
            import tensorflow_datasets as tfds
            self._sources = tfds.builder_from_directory(self.builder_dir).as_data_source()
        return self._sources[split]

    def units(self, splits: dict[str, str], at_least: int) -> list[Unit]:
        """`splits` {ours: theirs}; each split cut into about `at_least` units (more for
        big splits: a unit of at most 100,000 records), counted in records."""
        out = []
        for ours, theirs in splits.items():
            n = len(self.source(theirs))
            k = max(at_least, -(-n // 100_000), 1)
            edges = np.linspace(0, n, k + 1).astype(int)
            out += [Unit((theirs, int(a), int(b)), int(b - a), ours) for a, b in zip(edges[:-1], edges[1:])]
        return out

    def unit_documents(self, unit: Unit) -> Iterator:
        """The unit's documents: text (str) or token ids (int arrays) as the feature holds."""
        split, lo, hi = unit.where
        source = self.source(split)
        for start in range(lo, hi, RECORDS_PER_GROUP):
            for record in source.__getitems__(list(range(start, min(start + RECORDS_PER_GROUP, hi)))):
                value = record[self.feature]
                if isinstance(value, bytes):
                    yield value.decode("utf-8", errors="replace")
                elif isinstance(value, str):
                    yield value
                else:
                    yield np.asarray(value).reshape(-1)


def convert(builder, feature: str, splits: dict[str, str], spec: str, name: str, cache: str,
            workers: int) -> None:
    """A prepared TFDS dataset's (`builder`'s) `splits` ({ours: theirs}) tokenized with
    tokenizer `spec` into the token dataset `name` in `cache`, by every process and
    `workers` worker processes each (module docstring)."""
    import jax
    from jax.experimental import multihost_utils
    from meshtrain.data.tokenizers import load_tokenizer, make_tokenizer

    me, count = jax.process_index(), jax.process_count()

    def barrier(what: str) -> None:
        if count > 1:
            multihost_utils.sync_global_devices(f"meshtrain {what} {name}")
    dataset = builder.name
    records = CatalogRecords(str(builder.data_dir), feature, builder.as_data_source())
    units = records.units(splits, 4 * count * workers)
    root = Path(cache).expanduser() / f".{name}.prepare"
    # The units depend on the process and worker counts: a rerun with others starts over.
    plan = {"tfds": dataset, "feature": feature, "splits": splits, "tokenizer": spec,
            "units": [list(u.where) for u in units]}
    if me == 0:  # the others open it only once it is there, with the same plan: nothing removed
        work = tokenize_pool.Work(root, plan)
        if not (root / "tokenizer.json").exists():
            make_tokenizer(spec).save(root / "tokenizer.json")
    barrier("work directory ready for")
    work = work if me == 0 else tokenize_pool.Work(root, plan)
    tok = load_tokenizer(root / "tokenizer.json")
    mine = [k for k in range(len(units)) if k % count == me]
    bar = Progress(f"tokenize {dataset}" + (f" (process {me} of {count})" if count > 1 else ""),
                   sum(units[k].nbytes for k in mine), unit=" records")
    with tokenize_pool.pool(workers) as executor:
        tokenize_pool.tokenize(records, units, work, root / "tokenizer.json", executor, bar.update, only=mine)
        bar.close()
        barrier("units tokenized for")
        missing = [k for k in range(len(units)) if not work.done(k)] if me == 0 else []
        if missing:  # the other processes wrote theirs where process 0 cannot see them
            raise UserError(
                f"Converting {dataset}: units {missing[:5]} of {len(units)} were tokenized by other "
                f"processes but are not in {str(root)!r} here: data.cache_dir must be a directory every "
                f"process sees (a shared filesystem). Set data.cache_dir to one, or convert on one host.")
        if me == 0:
            token_shards.write(
                name, cache, tok, records, units, work, executor, workers=workers, fraction=0.0,
                record_tokens=token_dataset.DEFAULT_RECORD_TOKENS,
                extra_metadata={"source": {"tfds": dataset, "feature": feature, "splits": splits}})
            work.remove()
    barrier("dataset written:")
