"""prepare's tokenizing: the input cut into units, each tokenized once in a worker process
and kept on disk, so a killed prepare rerun does only the units left; then the units'
tokens, in input order, become the two splits' token streams.

    work = DATA_DIR/.NAME.prepare/
      plan.json          what the units were made from (inputs, sizes, mtimes, options);
                         a rerun with other inputs or options starts over
      tokenizer.json     the tokenizer every worker loads (a trained BPE is trained once)
      unit-K.tokens      unit K's documents' ids, each ending in end of text, in the
                         dataset's dtype, written to .tmp and renamed
      unit-K.ends        [documents] int64: where each document ends in unit-K.tokens
      unit-K.done        written last: the unit is whole

A unit is a file of the input (or the part of one before or after plain text's held-out
cut). Its split is fixed (plain text; records with --val_input), or set when the streams are
read: records hold out document i of the whole input when floor((i + 1) f) > floor(i f),
which needs only the documents' count before each unit, known once the units are done.
The streams are then slices of the units' files (`Stream`), and workers write the
dataset's shards from them (token_dataset.write_token_streams). Workers share nothing but
the files; the result is the same for any --workers.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import multiprocessing
import os
import shutil
from pathlib import Path

import numpy as np

from meshtrain.data import formats
from meshtrain.data.corpus import Unit, encode_group
from meshtrain.data.windows import token_dtype


def held_out(first: int, n: int, fraction: float) -> np.ndarray:
    """[n] bool: documents first..first+n-1 of the input held out (module docstring)."""
    i = np.arange(first, first + n, dtype=np.float64)
    return np.floor((i + 1) * fraction) > np.floor(i * fraction)


class Work:
    """The work directory of one prepare (module docstring)."""

    def __init__(self, root: Path, plan: dict):
        self.root = root
        old = root / "plan.json"
        if root.exists() and (not old.exists() or json.loads(old.read_text()) != plan):
            shutil.rmtree(root)  # another input or other options: nothing to resume
        root.mkdir(parents=True, exist_ok=True)
        old.write_text(json.dumps(plan))

    def done(self, k: int) -> bool:
        return (self.root / f"unit-{k}.done").exists()

    def documents(self, k: int) -> int:
        return json.loads((self.root / f"unit-{k}.done").read_text())["documents"]

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


_TOKENIZERS: dict = {}  # a worker loads the tokenizer once


def tokenize_unit(corpus, unit: Unit, k: int, root: str, tokenizer_path: str) -> int:
    """In a worker: unit k of `corpus` tokenized into the work directory; -> its input bytes."""
    from meshtrain.data.tokenizers import load_tokenizer
    if tokenizer_path not in _TOKENIZERS:
        _TOKENIZERS[tokenizer_path] = load_tokenizer(tokenizer_path)
    tok = _TOKENIZERS[tokenizer_path]
    dtype, base = token_dtype(tok.vocab_size), Path(root) / f"unit-{k}"
    ends, n, group = [], 0, []
    with open(f"{base}.tokens.tmp", "wb") as out:
        def flush():  # one write a group: a write and a cast per document cost a quarter of the unit
            nonlocal n
            docs = list(encode_group(tok, group))
            if docs:
                ends.extend((n + np.cumsum([len(d) for d in docs])).tolist())
                n = ends[-1]
                out.write(np.concatenate(docs).astype(dtype).tobytes())
            group.clear()
        for doc in corpus.unit_documents(unit):
            group.append(doc)
            if len(group) == formats.DOCS_PER_BATCH:
                flush()
        flush()
    with open(f"{base}.ends.tmp", "wb") as f:
        np.save(f, np.asarray(ends, np.int64))
    os.replace(f"{base}.tokens.tmp", f"{base}.tokens")
    os.replace(f"{base}.ends.tmp", f"{base}.ends")
    Path(f"{base}.done").write_text(json.dumps({"tokens": n, "documents": len(ends)}))
    return unit.nbytes


@contextlib.contextmanager
def pool(workers: int):
    """The worker processes every phase of one prepare shares (None for 1: in this process)."""
    if workers <= 1:
        yield None
        return
    # spawn: the parent has TensorFlow Datasets (and its threads) loaded; a fork would copy them.
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as ex:
        yield ex


def run(fn, tasks: list[tuple], executor, done) -> None:
    """fn(*task) for every task on `executor` (a `pool`; None: here, in order);
    `done(task, result)` as each ends."""
    if executor is None:
        for task in tasks:
            done(task, fn(*task))
        return
    futures = {executor.submit(fn, *task): task for task in tasks}
    for f in concurrent.futures.as_completed(futures):
        done(futures[f], f.result())


def tokenize(corpus, units: list[Unit], work: Work, tokenizer_path: Path, executor, progress,
             only: list[int] | None = None) -> None:
    """Every unit not done yet (of `only`, indices into `units`, when given: this process's
    share), on `executor` (a `pool`); `progress(n)` gets each unit's input bytes, those
    done before at once."""
    share = range(len(units)) if only is None else only
    todo = [k for k in share if not work.done(k)]
    progress(sum(units[k].nbytes for k in set(share) - set(todo)))
    run(tokenize_unit, [(corpus, units[k], k, str(work.root), str(tokenizer_path)) for k in todo], executor,
        lambda task, nbytes: progress(nbytes))


@dataclasses.dataclass(frozen=True)
class Stream:
    """A split's token stream: slices (unit, lo, hi) of the units' token files, in order,
    and the documents they hold."""

    root: str
    dtype: str
    pieces: tuple[tuple[int, int, int], ...]
    documents: int

    @property
    def tokens(self) -> int:
        return sum(hi - lo for _, lo, hi in self.pieces)

    def read(self, a: int, b: int) -> np.ndarray:
        """Tokens [a, b) of the stream."""
        starts = np.cumsum([0] + [hi - lo for _, lo, hi in self.pieces])
        i, out, files = int(np.searchsorted(starts, a, side="right")) - 1, [], {}
        size = np.dtype(self.dtype).itemsize
        try:
            while a < b:
                k, lo, hi = self.pieces[i]
                if k not in files:  # a unit's runs of documents are many pieces: open its file once
                    files[k] = open(Path(self.root) / f"unit-{k}.tokens", "rb")
                x, y = lo + a - int(starts[i]), min(hi, lo + b - int(starts[i]))
                # read, not mapped: a mapping's pages of every unit a held-out split touches
                # would stay in this process's memory
                files[k].seek(x * size)
                out.append(np.frombuffer(files[k].read((y - x) * size), self.dtype))
                a, i = a + y - x, i + 1
        finally:
            for f in files.values():
                f.close()
        return np.concatenate(out) if out else np.zeros(0, self.dtype)


def streams(work: Work, units: list[Unit], dtype, fraction: float) -> dict[str, Stream]:
    """Both splits' streams from the done units: a unit's split where it has one, else
    each document's (held_out, counting the documents of the units before)."""
    pieces, docs, first = {"train": [], "validation": []}, {"train": 0, "validation": 0}, 0
    for k, unit in enumerate(units):
        ends = np.load(work.root / f"unit-{k}.ends")
        if unit.split is not None:
            if len(ends):
                pieces[unit.split].append((k, 0, int(ends[-1])))
                docs[unit.split] += len(ends)
            continue
        held = held_out(first, len(ends), fraction)
        first += len(ends)
        starts = np.concatenate([[0], ends[:-1]])
        for split, keep in (("train", ~held), ("validation", held)):
            docs[split] += int(keep.sum())
            # runs of consecutive kept documents, one slice each
            edges = np.flatnonzero(np.diff(np.concatenate([[False], keep, [False]]).astype(np.int8)))
            pieces[split] += [(k, int(starts[a]), int(ends[b - 1])) for a, b in zip(edges[::2], edges[1::2])]
    return {split: Stream(str(work.root), np.dtype(dtype).name, tuple(pieces[split]), docs[split])
            for split in pieces}
