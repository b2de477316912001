"""What `meshtrain prepare --input=...` reads when the input is not plain text: documents
from records (JSON lines, parquet, a saved Hugging Face dataset), or token ids already
made (.bin token files), each with its held-out split. Plain text is
meshtrain/data/corpus.py's Corpus; all three give prepare the same interface:

    files, total (input bytes), read_total (what the two splits read: the progress bar's), info()
    documents(split, progress) -> str...       (records, text)
    tokens(tok, split, progress) -> [n] int32   each ending in end of text, or a run of them

The held-out split, records: the documents of `--val_input` when given, else a share
`val_fraction` of the documents spread evenly over the stream (document i is held out when
floor((i + 1) f) > floor(i f)), so it is read in one pass whatever the format and the same
documents in any format split the same way. Token files: `--val_input`'s files, else the
stream's tail from the first end of text at or after its (1 - f) point.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterator

import numpy as np

from meshtrain.data import formats
from meshtrain.data.corpus import check_val_fraction, encode_group, resolve_paths
from meshtrain.errors import UserError


class Records:
    """Documents from record files (formats.READERS), train and held out."""

    def __init__(self, path, fmt: str, field: str, *, val_fraction, val_path: str = ""):
        self.files = input_paths(path, "--input")
        self.val_files = input_paths(val_path, "--val_input") if val_path else []
        self.fmt, self.field, self.path = fmt, field, str(path)
        self.val_fraction = check_val_fraction(val_fraction)
        self.total = sum(_size(f) for f in self.files + self.val_files)
        # Bytes the two splits read: without --val_input each pass reads every file.
        self.read_total = self.total if self.val_files else 2 * self.total

    def documents(self, split: str, progress=None) -> Iterator[str]:
        if self.val_files:
            for f in (self.files if split == "train" else self.val_files):
                yield from self._read(f, progress)
            return
        i, f = 0, self.val_fraction
        for path in self.files:
            for doc in self._read(path, progress):
                held = math.floor((i + 1) * f) > math.floor(i * f)
                i += 1
                if held == (split == "validation"):
                    yield doc

    def _read(self, path: Path, progress) -> Iterator[str]:
        for docs, nbytes in formats.READERS[self.fmt](path, self.field):
            yield from (d for d in docs if d)
            if progress is not None:
                progress(nbytes)

    def text(self) -> str:
        return "".join(self.documents("train")) + "".join(self.documents("validation"))

    def tokens(self, tok, split: str, progress=None) -> Iterator[np.ndarray]:
        group: list[str] = []
        for doc in self.documents(split, progress):
            group.append(doc)
            if len(group) == formats._BATCH:
                yield from encode_group(tok, group)
                group = []
        yield from encode_group(tok, group)

    def describe_split(self) -> str:
        return (f"validation = {len(self.val_files)} file(s) of --val_input" if self.val_files else
                f"validation = {self.val_fraction:g} of the documents, spread evenly")

    def info(self) -> dict:
        return {"format": self.fmt, "text_field": self.field, "files": len(self.files), "bytes": self.total,
                "val_files": len(self.val_files), "val_fraction": None if self.val_files else self.val_fraction}


class TokenFiles:
    """Token ids already made (.bin files): the stream as it is, no tokenizer run."""

    fmt = "tokens"
    _CHUNK = 1 << 22  # tokens handed to the writer at a time

    def __init__(self, path, *, val_fraction, val_path: str = ""):
        self.files = input_paths(path, "--input")
        self.val_files = input_paths(val_path, "--val_input") if val_path else []
        self.path = str(path)
        self.val_fraction = check_val_fraction(val_fraction)
        self.arrays = {f: formats.token_file(f) for f in self.files + self.val_files}
        self.total = self.read_total = sum(a.nbytes for a in self.arrays.values())

    def check(self, tok) -> None:
        """Every id within `tok`'s vocabulary, and the stream holding its end of text."""
        for f, a in self.arrays.items():
            top = int(a.max()) if len(a) else -1
            if top >= tok.vocab_size:
                raise UserError(f"{str(f)!r} holds token id {top}, outside tokenizer {tok.describe()} "
                                f"({tok.vocab_size} ids): pass the --tokenizer these ids were made with "
                                f"(nanoGPT's and llm.c's GPT-2 files: --tokenizer=gpt2).")
        self.eot = tok.eot_id
        if not self.val_files:
            self.cut = self._cut()

    def _cut(self) -> int:
        stream = self._stream(self.files)
        n = sum(len(a) for a in stream)
        want, start = int(n * (1 - self.val_fraction)), 0
        for a in stream:
            if start + len(a) > want:
                ends = np.flatnonzero(a[max(want - start, 0):] == self.eot)
                if len(ends):
                    return start + max(want - start, 0) + int(ends[0]) + 1
            start += len(a)
        raise UserError(f"--input {self.path!r}: no end of text (id {self.eot}) in the last "
                        f"{self.val_fraction:g} of its {n:,} tokens to cut the held-out split at: pass "
                        f"--val_input with the held-out tokens, or the --tokenizer these ids were made with.")

    def _stream(self, files) -> list[np.ndarray]:
        return [self.arrays[f] for f in files]

    def tokens(self, tok, split: str, progress=None) -> Iterator[np.ndarray]:
        if self.val_files:
            parts = self._stream(self.files if split == "train" else self.val_files)
        else:
            parts, start = [], 0
            lo, hi = (0, self.cut) if split == "train" else (self.cut, None)
            for a in self._stream(self.files):
                end = start + len(a)
                a_lo, a_hi = max(lo - start, 0), len(a) if hi is None else min(hi - start, len(a))
                if a_lo < a_hi:
                    parts.append(a[a_lo:a_hi])
                start = end
        for a in parts:
            for i in range(0, len(a), self._CHUNK):
                chunk = np.asarray(a[i:i + self._CHUNK], np.int32)
                if progress is not None:
                    progress(chunk.nbytes * a.itemsize // 4)
                yield chunk

    def describe_split(self) -> str:
        return (f"validation = {len(self.val_files)} file(s) of --val_input" if self.val_files else
                f"validation = the last {self.val_fraction:g} of the tokens, from an end of text")

    def info(self) -> dict:
        return {"format": "tokens", "files": len(self.files), "bytes": self.total, "val_files": len(self.val_files),
                "tokens": int(sum(len(a) for a in self.arrays.values()))}


def input_paths(path, key: str) -> list[Path]:
    """A glob's files; a directory is one input (a save_to_disk dataset)."""
    text = str(path)
    if text and Path(text).expanduser().is_dir():
        return [Path(text).expanduser()]
    return resolve_paths(path, key)


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in formats.hf_files(path)) if path.is_dir() else path.stat().st_size
