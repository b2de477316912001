"""The files corpora come in, read as they are: which format a path is, and its documents.

    text     anything else that is UTF-8 text: a file is a document (or pieces of it, with
             a separator; meshtrain/data/corpus.py)
    jsonl    .jsonl / .json / .ndjson, optionally .gz or .zst: one JSON object a line, the
             document in its `field` (FineWeb, DCLM, SlimPajama, The Pile)
    parquet  .parquet: the `field` column, read a row group at a time (pyarrow)
    hf       a directory written by Hugging Face `datasets`' save_to_disk: its Arrow files
             read directly (pyarrow, no `datasets` needed); a DatasetDict's `train` split
    tokens   .bin: token ids already (meshtrain/data/token_files.py: nanoGPT's, llm.c's,
             Megatron-LM's beside its .idx)

A reader yields (documents, input bytes they came from): the bytes drive the progress bar.
A file whose first bytes say it is compressed or columnar is never read as text: the
error names its format (`sniff`).

Every container is read to its end and checked by what its writer stored, so a damaged
or cut file is refused, never read as a shorter corpus: gzip to its trailer (CRC-32 and
length), each zstd frame to its end (its content size and checksum where the writer
stored them: `ZstdFrames`), parquet by its footer's row counts and its pages' CRCs where
written, an Arrow stream to its end-of-stream marker with its arrays validated. Plain
text, plain JSON lines and raw ids carry nothing to check: docs/data.md, "Damaged inputs".
"""

from __future__ import annotations

import gzip
import io
import json
import zlib
from pathlib import Path
from typing import Iterator

from meshtrain.data.token_files import MEGATRON_MAGIC
from meshtrain.errors import UserError

FORMATS = ("text", "jsonl", "parquet", "hf", "tokens")
JSONL = (".jsonl", ".json", ".ndjson")
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
    suffix = path.suffix.lower()
    if suffix in (".gz", ".zst") and path.stat().st_size == 0:
        raise UserError(f"{str(path)!r} is empty (0 bytes), where even a compressed empty file has a header and an "
                        f"end: a copy cut at its start. Copy or download the file again.")
    raw = open(path, "rb")
    if suffix == ".gz":
        return io.TextIOWrapper(gzip.GzipFile(fileobj=raw), encoding="utf-8"), raw
    if suffix == ".zst":
        return io.TextIOWrapper(io.BufferedReader(ZstdFrames(raw, path)), encoding="utf-8"), raw
    return io.TextIOWrapper(raw, encoding="utf-8"), raw


class ZstdFrames(io.RawIOBase):
    """The decoded bytes of a .zst file's frames, each decoded to its end. zstandard's
    stream_reader ends quietly where a cut file ends, inside a frame, so a copy cut at a
    line break read as a shorter corpus; here input that ends inside a frame is a UserError
    naming the byte. zstd itself checks a frame's content size and checksum where the
    writer stored them (the zstd tool stores the checksum by default)."""

    def __init__(self, raw, path: Path):
        import zstandard
        self.raw, self.path, self.error = raw, path, zstandard.ZstdError
        self.dctx = zstandard.ZstdDecompressor()
        self.frame = None  # the frame being decoded, None between frames
        self.frames, self.fed, self.began = 0, 0, 0  # frames begun; input bytes read; where this frame began
        self.left, self.out = b"", b""  # input after a frame's end; output not returned yet

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self.out:
            data, self.left = self.left or self.raw.read(1 << 20), b""
            if not data:
                if self.frame is not None:
                    raise UserError(f"{str(self.path)!r} is truncated: it ends at byte {self.fed:,}, inside zstd "
                                    f"frame {self.frames} (from byte {self.began:,}) before that frame's end. "
                                    f"Copy or download the file again (`zstd -t` checks a copy).")
                return 0
            if self.frame is None:
                self.frame, self.frames, self.began = self.dctx.decompressobj(), self.frames + 1, self.fed
            self.fed += len(data)
            try:
                self.out = self.frame.decompress(data)
            except self.error as e:
                raise UserError(f"{str(self.path)!r} is damaged: zstd frame {self.frames} (from byte "
                                f"{self.began:,}) does not decode ({e}). Copy or download the file again.") from None
            if self.frame.eof:  # the rest of the input is the next frame's
                self.left, self.frame = self.frame.unused_data, None
                self.fed -= len(self.left)
        n = min(len(buffer), len(self.out))
        buffer[:n], self.out = self.out[:n], self.out[n:]
        return n


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
            except json.JSONDecodeError as e:  # e.msg may end in "at" ("Unterminated string starting at")
                cut = "" if row.endswith("\n") else (" It is the file's last line and no line break ends it: "
                                                     "the file looks cut short. Copy it again.")
                raise UserError(f"{line(n)}: not JSON ({e.msg.removesuffix(' at')} at column {e.pos + 1}); "
                                f"each line of a .jsonl file is one JSON object.{cut}") from None
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
    except EOFError as e:  # gzip: the input ended before a member's end
        raise UserError(f"{str(path)!r} is truncated: {e}. Copy or download the file again "
                        f"(`gzip -t` checks a copy).") from None
    except (OSError, zlib.error) as e:  # gzip: a bad header, CRC-32 or length; deflate data that does not decode
        raise UserError(f"{str(path)!r} is damaged: {e}. Copy or download the file again.") from None


def parquet(path: Path, field: str) -> Iterator[tuple[list[str], int]]:
    """Row groups of the `field` column, each checked against the footer's row count; pages
    checked against their CRC-32 where the writer stored one (pyarrow's write_page_checksum)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    where = str(path)
    try:
        f = pq.ParquetFile(path, page_checksum_verification=True)
    except (OSError, pa.ArrowException) as e:
        raise UserError(f"{where!r} is not a readable parquet file ({_reason(e)}): a file cut short loses the "
                        f"footer at its end. Copy or download the file again.") from None
    if field not in f.schema_arrow.names:
        raise UserError(f"{where!r}: no column {field!r} (it has {f.schema_arrow.names}). "
                        f"Pass --text_field=NAME.")
    size, rows = path.stat().st_size, max(f.metadata.num_rows, 1)
    for g in range(f.num_row_groups):
        want = f.metadata.row_group(g).num_rows
        try:
            column = f.read_row_group(g, columns=[field]).column(0)
            column.validate(full=True)
        except (OSError, pa.ArrowException) as e:
            raise UserError(f"{where!r} is damaged: row group {g} does not read ({_reason(e)}). Copy or "
                            f"download the file again.") from None
        if column.length() != want:
            raise UserError(f"{where!r} is damaged: row group {g} holds {column.length():,} rows, its footer says "
                            f"{want:,}. Copy or download the file again.")
        yield [_checked(v, field, path) for v in column.to_pylist()], size * column.length() // rows


ARROW_END = b"\xff\xff\xff\xff\x00\x00\x00\x00"  # an Arrow IPC stream's end-of-stream marker


def hf(path: Path, field: str) -> Iterator[tuple[list[str], int]]:
    """Batches of the `field` column of a saved dataset's Arrow streams, each read to its
    end-of-stream marker (a stream cut between batches reads as fewer rows without it) and
    its arrays validated (offsets within their buffers, UTF-8)."""
    import pyarrow as pa
    for arrow in hf_files(path):
        where = str(arrow)
        size = arrow.stat().st_size
        with pa.memory_map(where) as source:  # mapped: the table's columns stay on disk
            try:
                table = pa.ipc.open_stream(source).read_all()
                ended = source.tell()
                source.seek(max(size - len(ARROW_END), 0))
                tail = source.read(len(ARROW_END))
                if field in table.column_names:
                    table.column(field).validate(full=True)
            except (OSError, pa.ArrowException) as e:
                raise UserError(f"{where!r} is damaged: not a readable Arrow stream ({_reason(e)}). Copy the "
                                f"save_to_disk directory again.") from None
            if ended != size or tail != ARROW_END:
                how = f"ends at byte {ended:,} of {size:,}" if ended != size else "has no end-of-stream marker"
                raise UserError(f"{where!r} is truncated or damaged: its Arrow stream {how}. Copy the save_to_disk "
                                f"directory again.")
            if field not in table.column_names:
                raise UserError(f"{str(path)!r}: no column {field!r} (it has {table.column_names}). "
                                f"Pass --text_field=NAME.")
            for batch in table.select([field]).to_batches(max_chunksize=DOCS_PER_BATCH):
                rows = batch.column(0).to_pylist()
                yield [_checked(v, field, arrow) for v in rows], size * len(rows) // max(table.num_rows, 1)


def _reason(e: Exception) -> str:
    """A library's error in one line."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def hf_files(path: Path) -> list[Path]:
    """The Arrow files of a save_to_disk directory (a DatasetDict: its train split), in order;
    a UserError when its JSON is damaged or a file it lists is missing."""
    if path.suffix == ".arrow":
        return [path]
    if (path / "dataset_dict.json").exists():
        splits = _json(path / "dataset_dict.json").get("splits", [])
        if not isinstance(splits, list) or "train" not in splits:
            raise UserError(f"{str(path)!r} is a DatasetDict without a 'train' split (it has {splits}); "
                            f"pass the split's directory, e.g. --input="
                            f"{str(path / str(splits[0])) if isinstance(splits, list) and splits else 'DIR'}.")
        path = path / "train"
    state = _json(path / "state.json")
    try:
        files = [path / f["filename"] for f in state["_data_files"]]
    except (KeyError, TypeError) as e:
        raise UserError(f"{str(path)!r} is not a directory written by Hugging Face datasets' save_to_disk "
                        f"(its state.json lists the Arrow files: {e!r} is missing).") from None
    for f in files:
        if not f.is_file():
            raise UserError(f"{str(f)!r} is missing: {str(path / 'state.json')!r} lists it among the dataset's "
                            f"Arrow files. Copy the whole save_to_disk directory again.")
    return files


def _json(path: Path) -> dict:
    """A save_to_disk directory's JSON file, as a dict, or a UserError naming it."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"{str(path.parent)!r} is not a directory written by Hugging Face datasets' save_to_disk: "
                        f"its {path.name} {'is missing' if isinstance(e, FileNotFoundError) else 'does not read'} "
                        f"({_reason(e)}).") from None
    if not isinstance(value, dict):
        raise UserError(f"{str(path)!r} holds a JSON {type(value).__name__}, not the object save_to_disk writes: "
                        f"a damaged file. Copy the save_to_disk directory again.")
    return value


def _checked(value, field: str, path: Path) -> str:
    if not isinstance(value, str):
        raise UserError(f"{str(path)!r}: column {field!r} holds {type(value).__name__} values, not text. "
                        f"Pass the --text_field that holds the documents' text.")
    return value


READERS = {"jsonl": jsonl, "parquet": parquet, "hf": hf}
