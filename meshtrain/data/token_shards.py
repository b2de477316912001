"""prepare's two kinds of work, interleaved on one pool: units tokenized
(tokenize_pool.tokenize_unit) and the dataset's shards written from them
(tokenize_pool.write_token_shard).

A shard is written as soon as the units it reads are done: the splits' token streams
grow unit by unit, in input order, over the run of units done from the first
(`Splits`), and shard j of a split holds its stream's tokens [j S, (j+1) S). So the
shards' writing overlaps the tokenizing instead of following it, and what bounds a
prepare on a slow disk, the ids written twice (units, then shards), is spread over the
whole run. A unit's ids are deleted once no shard will read them again (every shard
that covers them is written): the work directory never holds the corpus's ids twice,
only the units whose shards are not all written (a validation shard of records held out
per document holds that share of a shard's size, so it spans the units a training shard
does: `shard_tokens`). Every file is the same
for any worker count and for a run stopped and rerun at any point
(tests/test_prepare_workers.py).

    work/shards/NAME-SPLIT.array_record-J       shard J, written to .tmp and renamed;
    work/shards/NAME-SPLIT.array_record-J.done  then its (records, bytes)

They are linked into the dataset (named -of-COUNT) once every unit is done.
"""

from __future__ import annotations

import bisect
import collections
import concurrent.futures
import os
import shutil
from pathlib import Path

import numpy as np

from meshtrain.data import token_dataset, tokenize_pool
from meshtrain.data.tfds_writer import Incomplete
from meshtrain.errors import UserError
from meshtrain.progress import Progress

SPLITS = ("train", "validation")


class Splits:
    """The two splits' streams over the units done so far, from the first in order: a
    unit's split where it has one, else each document's (tokenize_pool.held_out,
    counting the documents of the units before)."""

    def __init__(self, work: tokenize_pool.Work, units: list, dtype, fraction: float):
        self.work, self.units, self.dtype, self.fraction = work, units, np.dtype(dtype).name, fraction
        self.itemsize = np.dtype(dtype).itemsize
        self.pieces = {s: [] for s in SPLITS}  # (unit, lo, hi) slices of the units' files
        self.starts = {s: [0] for s in SPLITS}  # where each piece starts in its stream, then the end
        self.documents = {s: 0 for s in SPLITS}
        self.spans = []  # [unit] {split: (where its first piece starts, where its last ends) in the stream}
        self.first = 0  # documents before the next unit

    @property
    def ready(self) -> int:
        return len(self.spans)

    @property
    def complete(self) -> bool:
        return self.ready == len(self.units)

    def tokens(self, split: str) -> int:
        return self.starts[split][-1]

    def advance(self) -> None:
        """Adds the units done since, while they run on from the last one added."""
        while not self.complete and self.work.done(self.ready):
            k, unit = self.ready, self.units[self.ready]
            begin = {s: self.tokens(s) for s in SPLITS}
            ends = np.load(self.work.root / f"unit-{k}.ends")
            if unit.split is not None:
                self._add(unit.split, [(k, 0, int(ends[-1]))] if len(ends) else [], len(ends))
            else:
                held = tokenize_pool.held_out(self.first, len(ends), self.fraction)
                self.first += len(ends)
                starts = np.concatenate([[0], ends[:-1]])
                for split, keep in (("train", ~held), ("validation", held)):
                    # runs of consecutive kept documents, one slice each
                    edges = np.flatnonzero(np.diff(np.concatenate([[False], keep, [False]]).astype(np.int8)))
                    self._add(split, [(k, int(starts[a]), int(ends[b - 1])) for a, b in zip(edges[::2], edges[1::2])],
                              int(keep.sum()))
            self.spans.append({s: (begin[s], self.tokens(s)) for s in SPLITS})

    def _add(self, split: str, pieces: list, documents: int) -> None:
        self.documents[split] += documents
        for piece in pieces:
            self.pieces[split].append(piece)
            self.starts[split].append(self.starts[split][-1] + piece[2] - piece[1])

    def covered(self, k: int, split: str, made: int) -> bool:
        """Unit k's tokens in `split` all lie in the first `made` tokens of its stream (or it has none)."""
        begin, end = self.spans[k][split]
        return begin == end or end <= made

    def slice(self, split: str, a: int, b: int) -> tokenize_pool.Stream:
        """Tokens [a, b) of a split's stream (b at most its tokens so far)."""
        starts, pieces, out = self.starts[split], self.pieces[split], []
        i = max(bisect.bisect_right(starts, a) - 1, 0)
        while i < len(pieces) and starts[i] < b:
            k, lo, hi = pieces[i]
            x, y = lo + max(a - starts[i], 0), min(hi, lo + b - starts[i])
            if x < y:
                out.append((k, x, y))
            i += 1
        return tokenize_pool.Stream(str(self.work.root), self.dtype, tuple(out))


class Shards:
    """Each split's shards made so far, `[j] (stream, record_tokens, path, headers)`, those ready to
    write, and the units they still read."""

    def __init__(self, name: str, splits: Splits, per_shard: dict[str, int], record_tokens: int):
        self.name, self.splits, self.per_shard, self.record_tokens = name, splits, per_shard, record_tokens
        self.made = {s: [] for s in SPLITS}  # [j] (stream, record_tokens, path, headers)
        self.ready = collections.deque()
        self.readers = collections.Counter()  # unit -> shards made, not written yet, that read it
        self.live = []  # units done whose ids are still on disk

    def make(self) -> None:
        """The shards the units done so far fill (all that are left, once every unit is)."""
        splits, work, added = self.splits, self.splits.work, self.splits.ready
        splits.advance()
        self.live.extend(range(added, splits.ready))
        for split in SPLITS:
            tokens, its, size = splits.tokens(split), self.made[split], self.per_shard[split]
            n = max(-(-tokens // size), 1) if splits.complete else tokens // size
            while len(its) < n:
                j = len(its)
                stream = splits.slice(split, j * size, min((j + 1) * size, tokens))
                its.append((stream, self.record_tokens, str(work.shard(f"{self.name}-{split}.array_record-{j:05d}")),
                            self.headers(stream.tokens)))
                if work.written(its[-1][2]) is None:
                    self.ready.append(its[-1])
                    self.readers.update(its[-1][0].units())

    def headers(self, tokens: int) -> dict[int, bytes]:
        """{bytes: header} of the records of a shard of `tokens` (all whole but a split's last)."""
        r, size = self.record_tokens, self.splits.itemsize
        lengths = ({r} if tokens >= r else set()) | ({tokens % r} if tokens % r else set())
        return {n * size: token_dataset.record_header(n * size) for n in lengths}

    def wrote(self, task, result) -> None:
        self.splits.work.wrote(task[2], result)
        self.readers.subtract(task[0].units())

    def free(self) -> None:
        """Units no shard will read again: every shard covering them made, and written."""
        made = {s: len(self.made[s]) * self.per_shard[s] for s in SPLITS}
        for k in list(self.live):
            if not all(self.splits.covered(k, s, made[s]) for s in SPLITS):
                break  # the units after it are not covered either
            if self.readers[k] == 0:
                self.splits.work.free(k)
                self.live.remove(k)


def shard_tokens(units: list, fraction: float, tokens: int, record_tokens: int) -> dict[str, int]:
    """{split: tokens a shard holds}: about `tokens`, in whole records. With records held out
    per document, a validation shard holds the held-out share of that, so that it spans
    about the units a training shard does: a unit's ids are deleted once both shards that
    read them are written, and with validation shards of full size every unit would wait
    on disk for the one validation shard spanning 1 / fraction of them (at 0.05, 1.3 GB of
    ids for 64 MB shards, which the kernel writes out to disk only for them to be deleted)."""
    whole = max(tokens // record_tokens, 1)
    held = max(int(whole * fraction), 1) if any(u.split is None for u in units) and fraction > 0 else whole
    return {"train": whole * record_tokens, "validation": held * record_tokens}


def write(name: str, data_dir, tokenizer, corpus, units: list, work: tokenize_pool.Work, executor, *,
          workers: int, fraction: float, record_tokens: int, tokenize_bar: Progress | None = None,
          check=lambda splits: None,
          extra_metadata: dict | None = None, shard_bytes: int = token_dataset.TOKEN_SHARD_BYTES,
          replace: bool = False, records_label: str = "records") -> dict:
    """The units not done yet tokenized and the dataset's shards written, on `executor` (a
    tokenize_pool.pool of `workers`; None: here). `tokenize_bar` counts the units' input
    bytes (None: no bar); once every unit is done, `check(splits)` (the caller's refusals, naming
    its inputs), then an empty split is refused, then a bar counts the tokens of the shards
    still to write. replace: an existing dataset of that name is replaced at the end. -> the
    metadata."""
    dtype = np.dtype(token_dataset.token_dtype(tokenizer.vocab_size))
    splits = Splits(work, units, dtype, fraction)
    shards = Shards(name, splits, shard_tokens(units, fraction, shard_bytes // dtype.itemsize, record_tokens),
                    record_tokens)
    todo = collections.deque(k for k in range(len(units)) if not work.done(k))
    tokenize_bar = tokenize_bar or Progress("tokenize", 0, stream=_Silent())
    tokenize_bar.update(sum(u.nbytes for u in units) - sum(units[k].nbytes for k in todo))
    here, running, bar = _Here() if executor is None else executor, {}, None

    def tokenized():  # every unit done: the splits are whole
        tokenize_bar.close()
        check(splits)
        _no_empty_split(splits)

    shards.make()
    while todo or shards.ready or running:
        if splits.complete and bar is None:
            tokenized()
            left = [t for t in shards.ready] + [t for kind, t in running.values() if kind == "shard"]
            bar = Progress(records_label, sum(t[0].tokens for t in left), unit=" tokens")  # a true rate
        while len(running) < 2 * max(workers, 1) and (todo or shards.ready):
            if shards.ready:  # shards first: they free units, so the work directory stays small
                task = shards.ready.popleft()
                running[here.submit(tokenize_pool.write_token_shard, *task)] = ("shard", task)
            else:
                k = todo.popleft()
                task = (corpus, units[k], k, str(work.root), str(work.root / "tokenizer.json"))
                running[here.submit(tokenize_pool.tokenize_unit, *task)] = ("unit", task)
        done, _ = concurrent.futures.wait(list(running), return_when=concurrent.futures.FIRST_COMPLETED)
        for f in done:
            kind, task = running.pop(f)
            if kind == "unit":
                tokenize_bar.update(f.result())
                shards.make()
            else:
                shards.wrote(task, f.result())
                if bar is not None:
                    bar.update(task[0].tokens)
        shards.free()
    if bar is None:  # nothing was left to do
        tokenized()
    else:
        bar.close()
    return _finish(name, data_dir, tokenizer, dtype, record_tokens, splits, shards.made, extra_metadata, replace)


def _no_empty_split(splits: Splits) -> None:
    for split in SPLITS:
        if splits.tokens(split) == 0:
            raise UserError(f"The {split} split holds no document with text, so there would be nothing to "
                            f"{'train on' if split == 'train' else 'evaluate'}. Check the input's documents.")


def _finish(name, data_dir, tokenizer, dtype, record_tokens, splits, shards, extra_metadata, replace) -> dict:
    """The written shards linked into the dataset, with TFDS's description. -> the metadata."""
    metadata = token_dataset.token_metadata(tokenizer, record_tokens, dtype, extra_metadata)
    metadata["num_tokens"] = {s: splits.tokens(s) for s in SPLITS}
    metadata["num_documents"] = dict(splits.documents)
    with Incomplete(name, data_dir, token_dataset.token_features(dtype), token_dataset.description(tokenizer),
                    metadata) as out:
        infos = []
        for split in SPLITS:
            paths = [task[2] for task in shards[split]]
            results = [splits.work.written(path) for path in paths]
            for j, path in enumerate(paths):  # linked, not moved: a kill before the rename keeps them
                _link(Path(path), out.shard_path(split, j, len(paths)))
            infos.append(out.split_info(split, [r for r, _ in results], sum(b for _, b in results)))
        out.finish(infos, replace=replace)
    return dict(metadata)


class _Silent:
    """A stream that drops what a bar writes (a caller that shows its own)."""

    def write(self, text: str) -> None:
        pass

    def flush(self) -> None:
        pass


class _Here:
    """An executor that runs each task as it is submitted (--workers=1: no process)."""

    def submit(self, fn, *args) -> concurrent.futures.Future:
        f = concurrent.futures.Future()
        f.set_result(fn(*args))
        return f


def _link(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem, or one without hard links
        shutil.copyfile(src, dst)
