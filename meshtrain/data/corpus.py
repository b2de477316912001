"""A local text corpus: files (a path or a glob), documents, and the held-out cut.

Documents: each file is one document, or, with a separator (for example
"<|endoftext|>" or "\\n\\n"), each non-empty piece of a file between separators.
A token stream is the documents in order, each followed by the tokenizer's end of
text id, so no window is padded and a model sees where documents end.

Held-out split: the files, in sorted order, form one byte stream; the last
`val_fraction` of its bytes are held out, cut at a line break (else a character
boundary) inside the file the cut falls in. One file splits like nanoGPT's
Shakespeare (its tail is the validation text); many files give whole files to
the validation split, plus at most one tail.
"""

import dataclasses
import glob
import os
from pathlib import Path
from typing import Iterator

import numpy as np

from meshtrain.data.formats import sniff
from meshtrain.errors import UserError

_GLOB_CHARS = "*?["

# Documents tokenized per encode_batch call: large enough for the subword
# tokenizers' threads to help, small enough to keep memory flat.
_ENCODE_GROUP = 256


def resolve_paths(path, key: str = "data.path", is_input_dir=None) -> list[Path]:
    """The files `path` names: itself, or the sorted matches of a glob.

    `key` names the setting in errors (data.path for training, --input for prepare).
    `is_input_dir(dir) -> bool` says which directories are inputs themselves (prepare's
    saved Hugging Face datasets); without it a directory is never one.
    """
    if path is None or str(path) == "":
        raise UserError(
            f"{key} is not set. Set {key} to a text file (or a glob such as "
            f"'corpus/*.txt').")
    text = os.path.expanduser(str(path))
    taken = (lambda p: p.is_file() or (p.is_dir() and is_input_dir(p))) if is_input_dir else Path.is_file
    if any(c in text for c in _GLOB_CHARS):
        files = [f for f in sorted(Path(p) for p in glob.glob(text, recursive=True)) if taken(f)]
    else:
        if Path(text).is_dir() and not taken(Path(text)):
            raise UserError(
                f"{key} {str(path)!r} is a directory; it must name a text file or a glob "
                f"of files. To use the files in it, pass a glob such as "
                f"{os.path.join(str(path), '*.txt')!r}.")
        files = [Path(text)] if Path(text).exists() else []
    if not files:
        raise UserError(
            f"{key} {str(path)!r} matches no file (it resolves to "
            f"{os.path.abspath(text)!r}; relative paths are taken from the working "
            f"directory, {os.getcwd()!r}). Check the spelling, pass an absolute path, "
            f"or run from the directory the path is relative to.")
    return files


@dataclasses.dataclass(frozen=True)
class Unit:
    """One share of prepare's work (meshtrain/data/tokenize_pool.py): `where` is what the
    corpus reads it by, `nbytes` its input bytes; `split` None when the split is set per
    document as the streams are read."""

    where: tuple
    nbytes: int
    split: str | None


class Corpus:
    """Files, their sizes, and the byte offset where the held-out split begins.

    Attributes:
      files: sorted paths; sizes: bytes of each; total: sum of sizes.
      cut: global byte offset of the first held-out byte (0 < cut < total).
    """

    def __init__(self, path, *, val_fraction, separator: str | None = None,
                 key: str = "data.path", strict_utf8: bool = True):
        self.files = resolve_paths(path, key)
        for f in self.files:
            sniff(f)  # a compressed or columnar file is not text (meshtrain/data/formats.py)
        self.path = str(path)
        self.separator = separator or None
        self.strict_utf8 = strict_utf8
        self.sizes = [f.stat().st_size for f in self.files]
        self.total = sum(self.sizes)
        if self.total == 0:
            raise UserError(
                f"{key} {self.path!r} holds no text: {len(self.files)} file(s), all empty. "
                f"Point {key} at non-empty text files.")
        self.val_fraction = check_val_fraction(val_fraction)
        self.cut = self._find_cut()

    def documents(self, split: str, progress=None) -> Iterator[str]:
        """The documents of 'train' or 'validation', in order, as str.

        `progress(n)` is called with the bytes of each file slice as it is read.
        """
        for unit in self.units():
            if unit.split == split:
                yield from self.unit_documents(unit)
                if progress is not None:
                    progress(unit.nbytes)

    def units(self) -> list:
        """Each file's part before the held-out cut and after it."""
        out, start = [], 0
        for i, size in enumerate(self.sizes):
            for split, lo, hi in (("train", 0, self.cut), ("validation", self.cut, self.total)):
                a, b = max(lo, start) - start, min(hi, start + size) - start
                if a < b:
                    out.append(Unit((i, a, b), b - a, split))
            start += size
        return out

    def unit_documents(self, unit) -> Iterator[str]:
        i, a, b = unit.where
        with open(self.files[i], "rb") as f:  # the slice alone, not the whole file
            f.seek(a)
            text = self._decode(f.read(b - a), self.files[i])
        pieces = text.split(self.separator) if self.separator else [text]
        yield from (p for p in pieces if p)

    def text(self) -> str:
        """All documents, both splits, joined; for vocabularies built from the corpus."""
        return "".join(self._decode(f.read_bytes(), f) for f in self.files)

    def tokens(self, tok, split: str, progress=None) -> Iterator[np.ndarray]:
        """Each document of `split` encoded, end of text appended; [n_i + 1] int32."""
        group: list[str] = []
        for doc in self.documents(split, progress):
            group.append(doc)
            if len(group) == _ENCODE_GROUP:
                yield from encode_group(tok, group)
                group = []
        yield from encode_group(tok, group)

    fmt = "text"

    def describe_split(self) -> str:
        return f"validation = the last {self.val_fraction:g} of the bytes"

    def info(self) -> dict:
        return {"files": len(self.files), "bytes": self.total, "val_bytes": self.total - self.cut,
                "doc_separator": self.separator}

    def _find_cut(self) -> int:
        want = self.total - int(round(self.total * self.val_fraction))
        start = 0
        for f, size in zip(self.files, self.sizes):
            if start + size > want:
                break
            start += size
        data = f.read_bytes()
        local = want - start
        newline = data.rfind(b"\n", 0, local)
        if newline >= 0 and local - newline < max(1024, len(data) // 100):
            local = newline + 1  # a line break near the cut: hold out whole lines
        while 0 < local < len(data) and (data[local] & 0xC0) == 0x80:
            local -= 1  # never cut a UTF-8 character in two
        cut = start + local
        if not 0 < cut < self.total:
            raise UserError(
                f"data.val_fraction={self.val_fraction:g} leaves "
                f"{'no training' if cut <= 0 else 'no held-out'} text in {self.path!r} "
                f"({self.total} bytes). Use a larger corpus or a val_fraction nearer 0.1.")
        return cut

    def _decode(self, data: bytes, file: Path) -> str:
        if not self.strict_utf8:
            # surrogateescape keeps any byte sequence, so byte tokens round-trip exactly.
            return data.decode("utf-8", errors="surrogateescape")
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(
                f"{str(file)!r} is not valid UTF-8 ({e.reason} at byte {e.start}). "
                f"Convert the file to UTF-8, or use the byte tokenizer, which accepts "
                f"any bytes.") from None


def encode_group(tok, docs: list) -> Iterator[np.ndarray]:
    """Documents, all text (str) or all token ids already (int arrays: a catalog dataset's
    id feature, checked against the vocabulary) -> ids [n + 1] each, end of text last."""
    ids, lengths = encode_joined(tok, docs, np.int32)
    yield from np.split(ids, np.cumsum(lengths)[:-1]) if len(lengths) else ()


def encode_joined(tok, docs: list, dtype) -> tuple[np.ndarray, np.ndarray]:
    """encode_group's documents as one array: ([sum(n_i + 1)] ids in `dtype`, each document's
    end of text after it; [d] int64 lengths n_i + 1). One cast and one insert a group: a
    document at a time cost a quarter of prepare's tokenizing with the byte tokenizer."""
    if not docs:
        return np.zeros(0, dtype), np.zeros(0, np.int64)
    if isinstance(docs[0], str):
        docs = tok.encode_batch(docs)
    else:
        top = max((int(d.max()) for d in docs if d.size), default=0)
        if top >= tok.vocab_size:
            raise UserError(
                f"The dataset's token ids reach {top}, beyond the {tok.vocab_size} ids of "
                f"data.tokenizer ({tok.describe()}). Set data.tokenizer to the tokenizer the "
                f"dataset was made with.")
    lengths = np.fromiter((len(d) for d in docs), np.int64, len(docs))
    flat = np.concatenate([np.asarray(d).ravel() for d in docs]).astype(dtype, copy=False)
    return np.insert(flat, np.cumsum(lengths), tok.eot_id), lengths + 1


def check_val_fraction(val_fraction) -> float:
    ok = isinstance(val_fraction, (int, float)) and not isinstance(val_fraction, bool)
    if not ok or not 0 < val_fraction < 1:
        raise UserError(
            f"The validation fraction must be a number strictly between 0 and 1 (the "
            f"share of the corpus held out at its end for eval); got {val_fraction!r}. "
            f"Set it to, for example, 0.1.")
    return float(val_fraction)
