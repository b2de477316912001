"""What `meshtrain prepare --input=...` reads when the input is not plain text: documents
from records (JSON lines, parquet, a saved Hugging Face dataset), or token ids already
made (.bin token files: nanoGPT's, llm.c's, Megatron-LM's with its .idx), each with its
held-out split. Plain text is
meshtrain/data/corpus.py's Corpus; all three give prepare the same interface:

    files, total (input bytes: the progress bar's), info(), describe_split()
    units(), unit_documents(unit) -> str...    (records, text: what tokenize_pool's workers read)
    documents(split) -> str...                 (records, text: for a tokenizer built from them)
    tokens(tok, split, progress) -> [n] int32  (token files: runs of documents as they are)

The held-out split, records: the documents of `--val_input` when given, else a share
`val_fraction` of the documents spread evenly over the stream (document i is held out when
floor((i + 1) f) > floor(i f)), so it is read in one pass whatever the format and the same
documents in any format split the same way. Token files: `--val_input`'s files, else the
stream's tail from the first end of text at or after its (1 - f) point; a Megatron-LM
file's stream has an end of text after each document that lacks one (token_files.MegatronFile).
"""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Iterator

import numpy as np

from meshtrain.data import formats, token_files
from meshtrain.data.corpus import Unit, check_val_fraction, resolve_paths
from meshtrain.data.tokenize_pool import held_out
from meshtrain.errors import UserError


class Records:
    """Documents from record files (formats.READERS), train and held out."""

    def __init__(self, path, fmt: str, field: str, *, val_fraction, val_path: str = ""):
        self.files = input_paths(path, "--input")
        self.val_files = input_paths(val_path, "--val_input") if val_path else []
        self.fmt, self.field, self.path, self.val_path = fmt, field, str(path), str(val_path)
        self.val_fraction = check_val_fraction(val_fraction)
        self.total = sum(_size(f) for f in self.files + self.val_files)

    def documents(self, split: str, progress=None) -> Iterator[str]:
        if self.val_files:
            for f in (self.files if split == "train" else self.val_files):
                yield from self._read(f, progress)
            return
        i = 0
        for path in self.files:
            for doc in self._read(path, progress):
                if held_out(i, 1, self.val_fraction)[0] == (split == "validation"):
                    yield doc
                i += 1

    def units(self) -> list[Unit]:
        """A unit a file, or a run of lines of a large plain .jsonl file (formats.spans); the
        held-out documents are chosen as the streams are read."""
        def of(files, split):
            if self.fmt != "jsonl":
                return [Unit((str(f),), _size(f), split) for f in files]
            return [Unit((str(f),) if (a, b) == (0, _size(f)) else (str(f), a, b), b - a, split)
                    for f in files for a, b in formats.spans(f, _size(f))]
        return of(self.files, "train" if self.val_files else None) + of(self.val_files, "validation")

    def unit_documents(self, unit: Unit) -> Iterator[str]:
        return self._read(Path(unit.where[0]), None, tuple(unit.where[1:]) or None)

    def _read(self, path: Path, progress, span: tuple[int, int] | None = None) -> Iterator[str]:
        """The documents of a file (of its bytes [start, end) for a jsonl unit)."""
        read = formats.READERS[self.fmt]
        for docs, nbytes in (read(path, self.field) if span is None else read(path, self.field, span)):
            yield from (d for d in docs if d)
            if progress is not None:
                progress(nbytes)

    def text(self) -> str:
        return "".join(self.documents("train")) + "".join(self.documents("validation"))

    def describe_split(self) -> str:
        return (f"validation = {len(self.val_files)} file(s) of --val_input" if self.val_files else
                f"validation = {self.val_fraction:g} of the documents, spread evenly")

    def info(self) -> dict:
        return {"format": self.fmt, "text_field": self.field, "files": len(self.files), "bytes": self.total,
                "val_files": len(self.val_files), "val_fraction": None if self.val_files else self.val_fraction}


class TokenFiles:
    """Token ids already made (.bin files): the stream as it is, no tokenizer run. A file is
    read once the tokenizer is known (`check`): Megatron-LM's documents then get its end
    of text where they lack one."""

    fmt = "tokens"

    def __init__(self, path, *, val_fraction, val_path: str = ""):
        self.files = token_paths(path, "--input")
        self.val_files = token_paths(val_path, "--val_input") if val_path else []
        self.path, self.val_path = str(path), str(val_path)
        self.val_fraction = check_val_fraction(val_fraction)
        self.ids = {f: token_files.token_file(f) for f in self.files + self.val_files}
        self.headerless = [f for f, t in self.ids.items() if t.kind == token_files.NANOGPT]
        self.total = sum(t.nbytes for t in self.ids.values())

    def check(self, tok, spec: str = "") -> None:
        """Every id within `tok`'s vocabulary (`spec`: the --tokenizer that made it); each
        file's stream, its documents ended by `tok`'s end of text (one pass a file); both
        splits hold tokens; without --val_input, where the held-out split starts."""
        self.eot = self.separator = tok.eot_id
        named = {t.separator for t in self.ids.values()}
        if len(named) > 1:
            raise UserError(f"--input and --val_input mix token files whose documents are separated differently "
                            f"({', '.join(sorted(t.kind for t in self.ids.values()))}): prepare each kind apart.")
        if named != {""}:  # llm.c's Llama 3 files: <|begin_of_text|> before each document
            from meshtrain.data.hf_tokenizer import special_id
            self.separator = special_id(tok, named.pop())
            self.separator = tok.eot_id if self.separator is None else self.separator
        for f, t in list(self.ids.items()):
            (lo, hi), self.ids[f] = t.scan(self.eot)
            if lo < 0 or hi >= tok.vocab_size:
                raise UserError(_outside(f, t, lo, hi, tok, spec))
        self.total = sum(t.nbytes for t in self.ids.values())  # what tokens() reports: the ids inserted too
        for key, path, files in (("--input", self.path, self.files), ("--val_input", self.val_path, self.val_files)):
            if files and not sum(self.ids[f].count for f in files):
                raise UserError(f"{key} {path!r} holds no token ids ({len(files)} file(s): "
                                f"{', '.join(repr(str(f)) for f in files[:3])}{' ...' if len(files) > 3 else ''}), "
                                f"so the {'training' if key == '--input' else 'held-out'} split would be empty. "
                                f"Point {key} at the files that hold the ids.")
        if not self.val_files:
            self.cut = self._cut()

    def _cut(self) -> int:
        """The stream position after the first end of text at or past its (1 - f) point."""
        n = sum(self.ids[f].count for f in self.files)
        want, start = int(n * (1 - self.val_fraction)), 0
        for f in self.files:
            t = self.ids[f]
            lo = max(want - start, 0)
            for chunk in (t.chunks(lo) if lo < t.count else ()):
                ends = np.flatnonzero(chunk == self.separator)
                if len(ends):
                    cut = start + lo + int(ends[0]) + 1
                    if cut == n:
                        raise UserError(f"--input {self.path!r}: its only document separator (id "
                                        f"{self.separator}) in the last {self.val_fraction:g} of its {n:,} tokens is "
                                        f"its last token, so the held-out split would be empty: pass --val_input "
                                        f"with the held-out tokens, or a larger --val_fraction.")
                    return cut
                lo += len(chunk)
            start += t.count
        raise UserError(f"--input {self.path!r}: no document separator (id {self.separator}) in the last "
                        f"{self.val_fraction:g} of its {n:,} tokens to cut the held-out split at: pass "
                        f"--val_input with the held-out tokens, or the --tokenizer these ids were made with.")

    def tokens(self, tok, split: str, progress=None) -> Iterator[np.ndarray]:
        """`split`'s ids as int32 pieces, the held-out cut applied."""
        if self.val_files:
            ranges = [(self.ids[f], 0, None) for f in (self.files if split == "train" else self.val_files)]
        else:
            ranges, start = [], 0
            lo, hi = (0, self.cut) if split == "train" else (self.cut, None)
            for f in self.files:
                t = self.ids[f]
                a, b = max(lo - start, 0), t.count if hi is None else min(hi - start, t.count)
                if a < b:
                    ranges.append((t, a, b))
                start += t.count
        for t, a, b in ranges:
            for chunk in t.chunks(a, b):
                if progress is not None:
                    progress(len(chunk) * t.itemsize)
                yield chunk.astype(np.int32, copy=False)

    def describe_split(self) -> str:
        return (f"validation = {len(self.val_files)} file(s) of --val_input" if self.val_files else
                f"validation = the last {self.val_fraction:g} of the tokens, cut after a document separator")

    def info(self) -> dict:
        return {"format": "tokens", "files": len(self.files), "bytes": self.total, "val_files": len(self.val_files),
                "tokens": sum(t.count for t in self.ids.values())}


def _outside(path: Path, t, lo: int, hi: int, tok, spec: str) -> str:
    """Why a token file's ids [lo, hi] do not fit `tok` (made from --tokenizer=`spec`), and
    the tokenizer its format implies when it is not the one passed."""
    said = (f"{str(path)!r} ({t.kind}) holds ids {lo:,} to {hi:,}; tokenizer {tok.describe()} has ids 0 to "
            f"{tok.vocab_size - 1:,}")
    if lo < 0:
        return f"{said}: a negative id is no token, so the file is damaged. Copy it again from where it was made."
    if t.tokenizer and t.tokenizer != spec:
        return f"{said}: its format holds ids of --tokenizer={t.tokenizer}. Pass that."
    if not t.tokenizer and spec != "gpt2":
        return (f"{said}: pass the --tokenizer these ids were made with (nanoGPT's, llm.c's and Megatron's "
                f"GPT-2 files: --tokenizer=gpt2).")
    return (f"{said}: ids of a vocabulary of at least {hi + 1:,}, not this tokenizer's. Pass the --tokenizer these "
            f"ids were made with, or copy the file again if it should hold ids of this one.")


def token_paths(path, key: str) -> list[Path]:
    """input_paths of .bin token files, with no Megatron-LM file missing: an .idx the pattern
    names whose .bin is gone would drop its documents unseen, and a .bin whose .idx is gone,
    among others that have theirs, would read as raw ids."""
    pattern = os.path.expanduser(str(path))
    indexes = sorted(Path(p) for p in glob.glob(pattern[:-4] + ".idx", recursive=True)) \
        if pattern.lower().endswith(".bin") else []
    orphans = [i for i in indexes if not i.with_suffix(".bin").exists()]
    if orphans:
        raise UserError(f"{key} {str(path)!r}: the Megatron-LM index {str(orphans[0])!r} has no "
                        f"{orphans[0].with_suffix('.bin').name!r} beside it (the ids), so its documents would be "
                        f"left out. Copy the .bin of the same preprocess_data.py run beside it, or move the .idx "
                        f"away.")
    files = input_paths(path, key)
    indexed = [f for f in files if f.with_suffix(".idx").exists()]
    if indexed and len(indexed) < len(files):
        bare = next(f for f in files if f not in indexed)
        raise UserError(f"{key} {str(path)!r} mixes Megatron-LM files (a .idx beside each) with {str(bare)!r}, "
                        f"which has none: a Megatron .bin whose .idx is missing would be read as raw ids. Copy its "
                        f".idx beside it, or prepare the two kinds apart.")
    return files


def input_paths(path, key: str) -> list[Path]:
    """A path's or glob's files, and the save_to_disk directories it names (a directory
    is one input)."""
    saved = ("state.json", "dataset_dict.json")  # what save_to_disk writes
    folder = Path(os.path.expanduser(str(path)))
    if folder.is_dir() and not any((folder / f).exists() for f in saved) and any(folder.glob("*.arrow")):
        raise UserError(f"{key} {str(path)!r} holds Arrow files but no state.json, which Hugging Face datasets' "
                        f"save_to_disk writes to list them in order: a partial copy. Copy the whole directory again.")
    return resolve_paths(path, key, is_input_dir=lambda d: any((d / f).exists() for f in saved))


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in formats.hf_files(path)) if path.is_dir() else path.stat().st_size
