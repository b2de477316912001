"""The files corpora come in, read as they are: which format a path is, and its documents.

    text     anything else that is UTF-8 text: a file is a document (or pieces of it, with
             a separator; meshtrain/data/corpus.py)
    jsonl    .jsonl / .json / .ndjson, optionally .gz or .zst: one JSON object a line, the
             document in its `field` (FineWeb, DCLM, SlimPajama, The Pile)
    parquet  .parquet: the `field` column, read a row group at a time (pyarrow)
    hf       a directory written by Hugging Face `datasets`' save_to_disk: its Arrow files
             read directly (pyarrow, no `datasets` needed); a DatasetDict's `train` split
    tokens   .bin: token ids already, as nanoGPT writes them (raw uint16) or llm.c (a
             header of 256 int32: magic 20240520, version 1 (uint16) or 2 (uint32), count),
             or Megatron-LM's indexed dataset (PREFIX.bin beside its index PREFIX.idx)

A reader yields (documents, input bytes they came from): the bytes drive the progress bar.
A file whose first bytes say it is compressed or columnar is never read as text: the
error names its format (`sniff`).
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import json
from pathlib import Path
from typing import Iterator

import numpy as np

from meshtrain.errors import UserError

FORMATS = ("text", "jsonl", "parquet", "hf", "tokens")
JSONL = (".jsonl", ".json", ".ndjson")
LLMC_MAGIC = 20240520
MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
# Megatron-core's DType codes of integers; 6 (float64) and 7 (float32) hold no token ids.
MEGATRON_DTYPES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 8: "uint16"}
DOCS_PER_BATCH = 1024  # documents read per batch: small against memory, large for the tokenizer's threads
# A plain .jsonl file is cut into units of about this many bytes (prepare's workers share
# out units): a whole file of 128 MB left one worker idle for its last 2-3 s.
UNIT_BYTES = 32 << 20
# First bytes that no text file starts with, and what they are.
_MAGIC = {b"PAR1": "a parquet file (--format=parquet)", b"\x28\xb5\x2f\xfd": "zstd-compressed (.zst)",
          b"\x1f\x8b": "gzip-compressed (.gz)", b"ARROW1": "an Arrow file", b"\xff\xff\xff\xff": "an Arrow stream",
          b"PK\x03\x04": "a zip archive",
          MEGATRON_MAGIC: "a Megatron-LM index (.idx; pass its .bin)"}


def format_of(path: Path, given: str = "auto") -> str:
    """The format of `path`: `given` unless "auto", else by its name (module docstring)."""
    if given not in ("auto", *FORMATS):
        raise UserError(f"--format={given!r}: unknown; use one of auto, {', '.join(FORMATS)}.")
    if given != "auto":
        return given
    if path.is_dir():
        return "hf"
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in (".gz", ".zst"):
        suffixes = suffixes[:-1]
    last = suffixes[-1] if suffixes else ""
    # a .idx is half of Megatron's token files: token_file names it and asks for its .bin
    names = {".parquet": "parquet", ".bin": "tokens", ".idx": "tokens", ".arrow": "hf"}
    return names.get(last, "jsonl" if last in JSONL else "text")


def sniff(path: Path) -> None:
    """Refuses a file taken as text whose first bytes say it is something else."""
    with open(path, "rb") as f:
        head = f.read(9)
    for magic, what in _MAGIC.items():
        if head.startswith(magic):
            raise UserError(f"{str(path)!r} is {what}, not text: reading its bytes as text would train on "
                            f"them. Name it by its format (.jsonl.zst, .jsonl.gz, .parquet, a save_to_disk "
                            f"directory) or pass --format=jsonl|parquet|hf (docs/data.md, 'Inputs').")


def open_text(path: Path):
    """A text stream of a .jsonl, .jsonl.gz or .jsonl.zst file, and its raw byte stream
    (whose position is the input read so far)."""
    raw = open(path, "rb")
    suffix = path.suffix.lower()
    if suffix == ".gz":
        return io.TextIOWrapper(gzip.GzipFile(fileobj=raw), encoding="utf-8"), raw
    if suffix == ".zst":
        import zstandard
        return io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(raw), encoding="utf-8"), raw
    return io.TextIOWrapper(raw, encoding="utf-8"), raw


def spans(path: Path, size: int) -> list[tuple[int, int]]:
    """[(start, end)] byte ranges of a plain .jsonl file, each of about UNIT_BYTES and
    ending after a line break; [(0, size)] for a compressed or small one."""
    if path.suffix.lower() in (".gz", ".zst") or size <= UNIT_BYTES:
        return [(0, size)]
    cuts = [0]
    with open(path, "rb") as f:
        while cuts[-1] + UNIT_BYTES < size:
            f.seek(cuts[-1] + UNIT_BYTES)
            f.readline()  # on to the start of the next line
            if f.tell() >= size:
                break
            cuts.append(f.tell())
    return list(zip(cuts, cuts[1:] + [size]))


def _field(record, field: str, where) -> str:
    """record[field], text; where() names the record in an error."""
    if not isinstance(record, dict) or field not in record:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise UserError(f"{where()}: no field {field!r} (it has {keys}). Pass --text_field=NAME.")
    value = record[field]
    if not isinstance(value, str):
        raise UserError(f"{where()}: field {field!r} is a {type(value).__name__}, not text. Pass the "
                        f"--text_field that holds the documents' text.")
    return value


def jsonl(path: Path, field: str, span: tuple[int, int] | None = None) -> Iterator[tuple[list[str], int]]:
    """Batches of documents of a .jsonl (.gz, .zst) file, or of its bytes [start, end) of
    `spans`, with the input bytes each batch read."""
    if span is None:
        text, raw = open_text(path)
        before = 0
    else:  # a unit of a plain file: its lines read as the whole file's reader reads them
        with open(path, "rb") as f:
            f.seek(span[0])
            raw = io.BytesIO(f.read(span[1] - span[0]))
        text, before = io.TextIOWrapper(raw, encoding="utf-8"), None

    def line(n: int) -> str:  # "line N" of the whole file; counted only for an error
        nonlocal before
        if before is None:
            with open(path, "rb") as f:
                before = f.read(span[0]).count(b"\n")
        return f"{str(path)!r} line {before + n}"
    docs, seen = [], 0
    with text:
        for n, row in enumerate(_lines(text, path), 1):
            if not row.strip():
                continue
            try:
                record = json.loads(row)
            except json.JSONDecodeError as e:
                raise UserError(f"{line(n)}: not JSON ({e.msg} at column {e.colno}); each line "
                                f"of a .jsonl file is one JSON object.") from None
            docs.append(_field(record, field, lambda: line(n)))
            if len(docs) == DOCS_PER_BATCH:
                yield docs, raw.tell() - seen
                docs, seen = [], raw.tell()
        yield docs, raw.tell() - seen


def _lines(text, path: Path):
    try:
        yield from text
    except UnicodeDecodeError as e:
        raise UserError(f"{str(path)!r} is not UTF-8 JSON lines ({e.reason}).") from None
    except (EOFError, OSError) as e:  # a truncated or damaged .gz / .zst
        raise UserError(f"{str(path)!r} cannot be decompressed to the end: {e}") from None


def parquet(path: Path, field: str) -> Iterator[tuple[list[str], int]]:
    import pyarrow.parquet as pq
    try:
        f = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises its own ArrowInvalid for a damaged file
        raise UserError(f"{str(path)!r} is not a readable parquet file: {e}") from None
    if field not in f.schema_arrow.names:
        raise UserError(f"{str(path)!r}: no column {field!r} (it has {f.schema_arrow.names}). "
                        f"Pass --text_field=NAME.")
    size, rows = path.stat().st_size, max(f.metadata.num_rows, 1)
    for g in range(f.num_row_groups):
        column = f.read_row_group(g, columns=[field]).column(0)
        yield [_checked(v, field, path) for v in column.to_pylist()], size * column.length() // rows


def hf(path: Path, field: str) -> Iterator[tuple[list[str], int]]:
    import pyarrow as pa
    for arrow in hf_files(path):
        size = arrow.stat().st_size
        with pa.memory_map(str(arrow)) as source:  # mapped: the table's columns stay on disk
            table = pa.ipc.open_stream(source).read_all()
            if field not in table.column_names:
                raise UserError(f"{str(path)!r}: no column {field!r} (it has {table.column_names}). "
                                f"Pass --text_field=NAME.")
            for batch in table.select([field]).to_batches(max_chunksize=DOCS_PER_BATCH):
                rows = batch.column(0).to_pylist()
                yield [_checked(v, field, arrow) for v in rows], size * len(rows) // max(table.num_rows, 1)


def hf_files(path: Path) -> list[Path]:
    """The Arrow files of a save_to_disk directory (a DatasetDict: its train split), in order."""
    if path.suffix == ".arrow":
        return [path]
    if (path / "dataset_dict.json").exists():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        if "train" not in splits:
            raise UserError(f"{str(path)!r} is a DatasetDict without a 'train' split (it has {splits}); "
                            f"pass the split's directory, e.g. --input={str(path / splits[0]) if splits else 'DIR'}.")
        path = path / "train"
    try:
        state = json.loads((path / "state.json").read_text())
        return [path / f["filename"] for f in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{str(path)!r} is not a directory written by Hugging Face datasets' save_to_disk "
                        f"(its state.json lists the Arrow files: {e}).") from None


def _checked(value, field: str, path: Path) -> str:
    if not isinstance(value, str):
        raise UserError(f"{str(path)!r}: column {field!r} holds {type(value).__name__} values, not text. "
                        f"Pass the --text_field that holds the documents' text.")
    return value


READERS = {"jsonl": jsonl, "parquet": parquet, "hf": hf}


@dataclasses.dataclass(frozen=True)
class TokenFile:
    """The token ids of a .bin file: `count` of `dtype` from byte `offset`, read in pieces
    (a mapping of the whole file would keep every page it touched in memory)."""

    path: Path
    offset: int
    dtype: str
    count: int

    @property
    def nbytes(self) -> int:
        return self.count * np.dtype(self.dtype).itemsize

    def chunks(self, a: int = 0, b: int | None = None, size: int = 1 << 22) -> Iterator[np.ndarray]:
        """Ids [a, b), `size` at most a piece."""
        b = self.count if b is None else b
        with open(self.path, "rb") as f:
            for lo in range(a, b, size):
                f.seek(self.offset + lo * np.dtype(self.dtype).itemsize)
                yield np.frombuffer(f.read((min(lo + size, b) - lo) * np.dtype(self.dtype).itemsize), self.dtype)

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    def scan(self, eot: int) -> tuple[int, "TokenFile"]:
        """(its largest id, -1 if none; its stream: itself, its documents ended by end of text already)."""
        return max((int(c.max()) for c in self.chunks() if len(c)), default=-1), self


def token_file(path: Path) -> "TokenFile | MegatronFile":
    """A .bin file of token ids: Megatron-LM's (a .idx of the same stem beside it), llm.c's
    (its header read) or nanoGPT's (raw uint16)."""
    if path.suffix.lower() == ".idx":
        raise UserError(f"{str(path)!r} is a Megatron-LM index, read with its .bin: name the .bin files "
                        f"(--input='DIR/*.bin'), not the .idx.")
    if path.with_suffix(".idx").exists():
        return megatron_file(path, path.with_suffix(".idx"))
    size = path.stat().st_size
    header = np.fromfile(path, np.int32, count=256) if size >= 1024 else np.zeros(0, np.int32)
    if len(header) and header[0] == LLMC_MAGIC:
        if header[1] not in (1, 2):
            raise UserError(f"{str(path)!r}: llm.c token file of version {header[1]}; known: 1 (uint16), 2 (uint32).")
        dtype = np.dtype(np.uint16 if header[1] == 1 else np.uint32)
        if (size - 1024) // dtype.itemsize != header[2] or (size - 1024) % dtype.itemsize:
            raise UserError(f"{str(path)!r}: its llm.c header says {header[2]:,} tokens, the file holds "
                            f"{(size - 1024) / dtype.itemsize:,.1f}: a truncated or damaged file.")
        return TokenFile(path, 1024, dtype.name, int(header[2]))
    if size % 2:
        raise UserError(f"{str(path)!r} has an odd number of bytes ({size:,}): not a nanoGPT token file "
                        f"(uint16 ids) nor an llm.c one (a 1,024-byte header of magic {LLMC_MAGIC}).")
    return TokenFile(path, 0, "uint16", size // 2)


# Megatron-LM's indexed dataset is read with numpy: Megatron-core itself (torch, its C++
# dataset helpers, NVIDIA's training stack) is a heavyweight library to import for a
# 34-byte header and three arrays.
_MEGATRON_HEADER = 34  # magic (9 bytes), version (uint64), dtype code (uint8), S and D (uint64)


def megatron_file(path: Path, idx: Path) -> "MegatronFile":
    """PREFIX.bin read by its index PREFIX.idx. The .bin is read front to back, so its
    sequences must lie one after another in order, as Megatron's preprocess_data.py and
    IndexedDatasetBuilder write them."""
    dtype, lengths, offsets, firsts = _megatron_index(idx)
    where = f"{str(path)!r} (with {idx.name!r})"
    starts = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])  # [S + 1]: each sequence's first id
    base = int(offsets[0]) if len(offsets) else 0
    moved = np.flatnonzero(offsets != base + starts[:-1] * dtype.itemsize)
    if len(moved):
        i = int(moved[0])
        raise UserError(f"{where}: sequence {i} is at byte {offsets[i]:,}, not {base + starts[i] * dtype.itemsize:,} "
                        f"right after the one before: meshtrain reads the sequences one after another, as "
                        f"Megatron writes them. Rewrite the dataset with Megatron's IndexedDatasetBuilder.")
    size, want = path.stat().st_size, base + int(starts[-1]) * dtype.itemsize
    if size != want:
        raise UserError(f"{where}: its index says {int(starts[-1]):,} {dtype.name} ids from byte {base:,}, "
                        f"{want:,} bytes; the .bin holds {size:,}: {'truncated' if size < want else 'longer'}, "
                        f"or not the .bin of this index. Copy the .bin and .idx of one preprocess_data.py run again.")
    ends, begins = starts[firsts[1:]], starts[firsts[:-1]]
    return MegatronFile(path, base, dtype.name, int(starts[-1]), ends[ends > begins])


def _megatron_index(idx: Path) -> tuple[np.dtype, np.ndarray, np.ndarray, np.ndarray]:
    """A checked .idx (little-endian: b"MMIDIDX\\0\\0", version 1, dtype code, S, D) -> (the ids'
    dtype, lengths int32[S], byte offsets int64[S], each document's first sequence int64[D]:
    0 first, S last)."""
    with open(idx, "rb") as f:
        head = f.read(_MEGATRON_HEADER)
    where, fix = str(idx), "Copy the .bin and .idx of one preprocess_data.py run again, or rerun it."
    if head[:9] != MEGATRON_MAGIC:
        raise UserError(f"{where!r} starts {head[:9]!r}, not {MEGATRON_MAGIC!r}: not a Megatron-LM index, so "
                        f"{idx.with_suffix('.bin').name!r} beside it cannot be read. {fix} (A .bin of nanoGPT's "
                        f"or llm.c's has no .idx beside it.)")
    if len(head) < _MEGATRON_HEADER:
        raise UserError(f"{where!r}: {len(head)} bytes, shorter than a Megatron index's 34-byte header. {fix}")
    version, code = np.frombuffer(head, "<u8", 1, 9)[0], head[17]
    if version != 1:
        raise UserError(f"{where!r}: Megatron index version {version}; meshtrain reads version 1, the one "
                        f"Megatron-core's IndexedDataset writes. {fix}")
    if code not in MEGATRON_DTYPES:
        what = {6: "float64", 7: "float32"}.get(code, "unknown")
        raise UserError(f"{where!r}: dtype code {code} ({what}), not token ids: known are "
                        f"{', '.join(f'{c} ({d})' for c, d in MEGATRON_DTYPES.items())}. {fix}")
    s, d = (int(n) for n in np.frombuffer(head, "<u8", 2, 18))  # sequences S, document indices D
    size, want = idx.stat().st_size, _MEGATRON_HEADER + 12 * s + 8 * d
    if size != want:
        raise UserError(f"{where!r}: {size:,} bytes, where its {s:,} sequences and {d:,} document indices take "
                        f"{want:,}: truncated, or damaged (a multimodal index, with sequence modes, is not "
                        f"token text). {fix}")
    lengths = np.fromfile(idx, "<i4", s, offset=_MEGATRON_HEADER)
    offsets = np.fromfile(idx, "<i8", s, offset=_MEGATRON_HEADER + 4 * s)
    firsts = np.fromfile(idx, "<i8", d, offset=_MEGATRON_HEADER + 12 * s)
    if d < 1 or firsts[0] != 0 or firsts[-1] != s or np.any(np.diff(firsts) < 0) or np.any(lengths < 0):
        raise UserError(f"{where!r}: its document indices are not 0, ..., {s:,} in order, or a sequence "
                        f"length is negative: a damaged index. {fix}")
    return np.dtype(MEGATRON_DTYPES[code]), lengths, offsets, firsts


@dataclasses.dataclass(frozen=True)
class MegatronFile(TokenFile):
    """A Megatron-LM dataset's ids (its sequences, one after another) and `ends` [documents]
    int64: the id position after each document that has ids (empty ones are left out)."""

    ends: np.ndarray

    def scan(self, eot: int) -> tuple[int, "Ended"]:
        """(its largest id; its stream: `eot` inserted after each document not ending in it,
        as Megatron's preprocess_data.py writes them without --append-eod). One pass, in pieces."""
        last, top, lo = self.ends - 1, -1, 0
        tails = np.empty(len(last), np.int64)  # each document's last id
        for chunk in self.chunks():
            if chunk.min() < 0:  # a signed dtype's damage would pass the vocabulary check
                raise UserError(f"{str(self.path)!r} holds token id {int(chunk.min())}: a damaged file. "
                                f"Copy the .bin and .idx of one preprocess_data.py run again.")
            top = max(top, int(chunk.max()))
            i, j = np.searchsorted(last, [lo, lo + len(chunk)])
            tails[i:j] = chunk[last[i:j] - lo]
            lo += len(chunk)
        return top, Ended(self, self.ends[tails != eot], eot)


@dataclasses.dataclass(frozen=True)
class Ended:
    """A file's stream: its ids with `eot` inserted before the id positions `at` [k] int64
    (increasing), read as int32 pieces."""

    ids: TokenFile
    at: np.ndarray
    eot: int

    @property
    def count(self) -> int:
        return self.ids.count + len(self.at)

    @property
    def itemsize(self) -> int:
        return self.ids.itemsize

    @property
    def nbytes(self) -> int:
        return self.count * self.itemsize

    def chunks(self, a: int = 0, b: int | None = None, size: int = 1 << 22) -> Iterator[np.ndarray]:
        """Stream ids [a, b): pieces of at most `size` file ids and the ids inserted among them."""
        b = self.count if b is None else b
        placed = self.at + np.arange(len(self.at))  # the inserted ids' stream positions
        k, before_b = (int(n) for n in np.searchsorted(placed, [a, b]))  # how many lie before a, before b
        lo, pos = a - k, a  # lo: the file position of stream position a, or of the id after it
        if k < len(placed) and placed[k] == a < b:  # a is an inserted id: it ends the document before lo
            yield np.array([self.eot], np.int32)
            k, pos = k + 1, a + 1
        for chunk in self.ids.chunks(lo, b - before_b, size):
            hi = lo + len(chunk)
            j = int(np.searchsorted(self.at, hi, "right"))  # the ids inserted after file ids [lo, hi)
            piece = np.insert(chunk.astype(np.int32), self.at[k:j] - lo, self.eot)[:b - pos]
            yield piece
            lo, k, pos = hi, j, pos + len(piece)
