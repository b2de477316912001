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
      shards/            the dataset's shards (meshtrain/data/token_shards.py); a unit's
                         tokens are deleted once every shard that reads them is written

A unit is a file of the input (a run of lines of a large plain .jsonl file; the part of
a text file before or after plain text's held-out cut). Its split is fixed (plain text;
records with --val_input), or set when the streams are read: records hold out document i
of the whole input when floor((i + 1) f) > floor(i f), which needs only the documents'
count before each unit, known once the units before it are done. The streams are then
slices of the units' files (`Stream`), and workers write the dataset's shards from them
as the units are done (meshtrain/data/token_shards.py). Workers share nothing but the
files; the result is the same for any --workers.
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
from meshtrain.data.corpus import Unit, encode_joined
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

    def shard(self, name: str) -> Path:
        """Where the dataset's shard `name` is written, and kept for a rerun (module docstring)."""
        (self.root / "shards").mkdir(exist_ok=True)
        return self.root / "shards" / name

    def written(self, path: Path) -> tuple[int, int] | None:
        """(records, bytes) of a shard an earlier run (or this one) finished, else None."""
        done = Path(f"{path}.done")
        return tuple(json.loads(done.read_text())) if done.exists() else None

    def wrote(self, path: Path, result: tuple[int, int]) -> None:
        Path(f"{path}.done.tmp").write_text(json.dumps(list(result)))
        os.replace(f"{path}.done.tmp", f"{path}.done")

    def free(self, k: int) -> None:
        """Unit k's tokens, once every shard that reads them is written; its ends and its
        done mark stay, for the streams a rerun rebuilds."""
        (self.root / f"unit-{k}.tokens").unlink(missing_ok=True)


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
            ids, lengths = encode_joined(tok, group, dtype)
            ends.extend((n + np.cumsum(lengths)).tolist())
            n += len(ids)
            out.write(ids.data)
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


def write_token_shard(stream: "Stream", record_tokens: int, path: str, headers: dict[int, bytes]) -> tuple[int, int]:
    """In a worker: `stream`'s tokens as records of `record_tokens` in one shard of the
    dataset, uncompressed (token ids barely compress, and training reads them back at every
    step); written to PATH.tmp and renamed. A record is headers[its bytes] then its ids
    (token_dataset.record_header: made by the parent, as TFDS would cost each worker 0.55 s
    to import). -> (records, bytes)."""
    from meshtrain.data.tfds_writer import write_shard

    def records():
        step = record_tokens * max(1, (1 << 20) // record_tokens)  # about 1M tokens a read: a buffer reused
        for a in range(0, stream.tokens, step):
            tokens = stream.read(a, min(a + step, stream.tokens))
            for i in range(0, len(tokens), record_tokens):
                raw = tokens[i:i + record_tokens].tobytes()
                yield headers[len(raw)] + raw
    result = write_shard(Path(f"{path}.tmp"), records(), "group_size:1,uncompressed,max_parallelism:1")
    os.replace(f"{path}.tmp", path)
    return result


@contextlib.contextmanager
def pool(workers: int):
    """The worker processes every phase of one prepare shares (None for 1: in this process)."""
    if workers <= 1:
        yield None
        return
    # spawn: the parent has TensorFlow Datasets (and its threads) loaded; a fork would copy them.
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as ex:
        for _ in range(workers):  # each starts and imports now, while the caller goes on (about 1 s)
            ex.submit(_start)
        yield ex


def _start() -> None:
    """A worker's imports, before its first task: what a unit's and a shard's tasks load."""
    import importlib
    for module in ("meshtrain.data.inputs", "meshtrain.data.tfds_writer", "meshtrain.data.tokenizers"):
        importlib.import_module(module)


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
    """A split's token stream, or a shard's part of it: slices (unit, lo, hi) of the units'
    token files, in order."""

    root: str
    dtype: str
    pieces: tuple[tuple[int, int, int], ...]

    @property
    def tokens(self) -> int:
        return sum(hi - lo for _, lo, hi in self.pieces)

    def units(self) -> set[int]:
        return {k for k, _, _ in self.pieces}

    def read(self, a: int, b: int) -> np.ndarray:
        """Tokens [a, b) of the stream, read into one array (no copy after the read)."""
        starts = np.cumsum([0] + [hi - lo for _, lo, hi in self.pieces])
        i, files = int(np.searchsorted(starts, a, side="right")) - 1, {}
        out = np.empty(max(b - a, 0), self.dtype)
        view, size, at = memoryview(out).cast("B"), out.itemsize, 0
        try:
            while a < b:
                k, lo, hi = self.pieces[i]
                if k not in files:  # a unit's runs of documents are many pieces: open its file once
                    files[k] = open(Path(self.root) / f"unit-{k}.tokens", "rb", buffering=0)
                x, y = lo + a - int(starts[i]), min(hi, lo + b - int(starts[i]))
                # read, not mapped: a mapping's pages of every unit a held-out split touches
                # would stay in this process's memory
                files[k].seek(x * size)
                end = at + (y - x) * size
                while at < end:
                    got = files[k].readinto(view[at:end])
                    if not got:
                        raise OSError(f"{files[k].name} ends before token {y}: a damaged work directory")
                    at += got
                a, i = a + y - x, i + 1
        finally:
            for f in files.values():
                f.close()
        return out
