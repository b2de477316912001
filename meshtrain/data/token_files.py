"""Token files: ids already made (.bin), read as the peers that make them write them.

    nanoGPT   raw uint16 ids, no header (its data/*/prepare.py: `ids.tofile(...)`). Nothing
              in the file says where it ends: a copy cut at an even byte reads as a shorter
              stream, which no reader can see (docs/data.md, "Damaged inputs").
    llm.c     a header of 256 int32 (magic, version, token count, then zeros) and the ids
              (dev/data/data_common.py, write_datafile):
                magic 20240520 version 1: uint16 ids   write_datafile(..., "gpt-2")
                magic 20240801 version 7: uint32 ids   write_datafile(..., "llama-3")
              The count is checked against the file's size. A file whose first int32 has a
              magic's shape (a date, YYYYMMDD, then a small version) but no known pair, or
              that ends inside its header, is refused: read as raw uint16, its header and
              each uint32 id would become ids.
    Megatron  PREFIX.bin beside its index PREFIX.idx (tools/preprocess_data.py): the ids of
              its sequences, read by the index; both files' sizes are checked against the
              index's counts.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Iterator

import numpy as np

from meshtrain.errors import UserError

LLMC_HEADER_BYTES = 1024  # 256 int32
# (magic, version) -> (the ids' dtype, what writes it, the --tokenizer of its ids, the token
# before each document). llm.c's Llama 3 files separate documents with what the tokenizer
# adds by default, <|begin_of_text|> (dev/data/*.py: `eot = tokenizer.encode('')[0]`).
LLMC_FORMATS = {(20240520, 1): ("uint16", "llm.c's GPT-2 format", "gpt2", ""),
                (20240801, 7): ("uint32", "llm.c's Llama 3 format",
                                "hf:DIR, DIR holding Llama 3's tokenizer.model or tokenizer.json (128,256 ids)",
                                "<|begin_of_text|>")}
LLMC_MAGIC = 20240520
LLMC_EVAL_MAGIC = 20240522  # llm.c's write_evalfile: HellaSwag/MMLU examples, not a token stream
MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
# Megatron-core's DType codes of integers; 6 (float64) and 7 (float32) hold no token ids.
MEGATRON_DTYPES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 8: "uint16"}
_MAGICS = [np.int32(m).tobytes() for m in sorted({m for m, _ in LLMC_FORMATS} | {LLMC_EVAL_MAGIC})]
NANOGPT = "nanoGPT's raw uint16 ids, no header"  # a TokenFile's kind: nothing says where the file ends
_KNOWN = ", ".join(f"{m} version {v} ({d})" for (m, v), (d, *_) in LLMC_FORMATS.items())
_REFETCH = "Copy the file again from where it was made, or make it again."


@dataclasses.dataclass(frozen=True)
class TokenFile:
    """The token ids of a .bin file: `count` of `dtype` from byte `offset`, read in pieces
    (a mapping of the whole file would keep every page it touched in memory); `kind` says
    which format it is and `tokenizer` the --tokenizer its format implies ("": none), for
    messages; `separator` the special token its documents are separated by ("": the
    tokenizer's end of text)."""

    path: Path
    offset: int
    dtype: str
    count: int
    kind: str
    tokenizer: str
    separator: str

    @property
    def nbytes(self) -> int:
        return self.count * self.itemsize

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    def chunks(self, a: int = 0, b: int | None = None, size: int = 1 << 22) -> Iterator[np.ndarray]:
        """Ids [a, b), `size` at most a piece."""
        b = self.count if b is None else b
        with open(self.path, "rb") as f:
            for lo in range(a, b, size):
                f.seek(self.offset + lo * self.itemsize)
                want = (min(lo + size, b) - lo) * self.itemsize
                data = f.read(want)
                if len(data) != want:  # shortened since it was opened
                    at = self.offset + lo * self.itemsize + len(data)
                    raise UserError(f"{str(self.path)!r} ended at byte {at:,} "
                                    f"while being read; it held {self.offset + self.nbytes:,} bytes when opened. "
                                    f"Prepare from a copy that nothing writes to.")
                yield np.frombuffer(data, self.dtype)

    def scan(self, eot: int) -> tuple[tuple[int, int], "TokenFile"]:
        """((its smallest id, its largest; (0, -1) if none), its stream: itself, its
        documents ended by end of text already)."""
        span = (0, -1)
        for chunk in self.chunks():
            span = _widen(span, chunk)
        return span, self


def _widen(span: tuple[int, int], chunk: np.ndarray) -> tuple[int, int]:
    """(smallest id, largest) of the ids seen so far and `chunk`; (0, -1) before any."""
    if not len(chunk):
        return span
    lo, hi = int(chunk.min()), int(chunk.max())
    return (lo, hi) if span[1] < 0 else (min(span[0], lo), max(span[1], hi))


def token_file(path: Path) -> "TokenFile | MegatronFile":
    """A .bin file of token ids: Megatron-LM's (a .idx of the same stem beside it), llm.c's
    (its header read) or nanoGPT's (raw uint16). Module docstring."""
    if path.suffix.lower() == ".idx":
        raise UserError(f"{str(path)!r} is a Megatron-LM index, read with its .bin: name the .bin files "
                        f"(--input='DIR/*.bin'), not the .idx.")
    if path.with_suffix(".idx").exists():
        return megatron_file(path, path.with_suffix(".idx"))
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(LLMC_HEADER_BYTES)
    if _llmc_shaped(head, size):
        return _llmc_file(path, size, np.frombuffer(head[:len(head) // 4 * 4], "<i4"))
    where = str(path)
    if path.name.endswith(("_document.bin", "_sentence.bin")):
        raise UserError(f"{where!r} is named as Megatron-LM's preprocess_data.py names its output, but its index "
                        f"{path.with_suffix('.idx').name!r} is not beside it: without the index the ids cannot be "
                        f"split into documents. Copy the .idx of the same run beside it.")
    if size % 2:
        raise UserError(f"{where!r} has an odd number of bytes ({size:,}): not nanoGPT's raw uint16 ids, nor an "
                        f"llm.c token file (a {LLMC_HEADER_BYTES:,}-byte header: magic {_KNOWN}). {_REFETCH}")
    return TokenFile(path, 0, "uint16", size // 2, NANOGPT, "", "")


def _llmc_shaped(head: bytes, size: int) -> bool:
    """Whether the file's first bytes are (the start of) an llm.c header: a known magic; an
    int32 shaped like one (a date, 2020-2099) then a version 1-255; or, whatever its first
    three int32 say (a damaged header), the 1,012 zero bytes llm.c writes after them. Raw
    uint16 ids start so only when their first ids spell a date and a small number, or when
    506 ids after the sixth are all 0."""
    if len(head) < 4:
        return bool(head) and any(m.startswith(head) for m in _MAGICS)
    if head[:4] in _MAGICS:
        return True
    header = np.frombuffer(head[:len(head) // 4 * 4], "<i4")
    year, month, day = header[0] // 10000, header[0] // 100 % 100, header[0] % 100
    if len(header) >= 2 and 2020 <= year < 2100 and 1 <= month <= 12 and 1 <= day <= 31 and 0 < header[1] < 256:
        return True
    return len(header) == 256 and size > LLMC_HEADER_BYTES and not header[3:].any()


def _llmc_file(path: Path, size: int, header: np.ndarray) -> TokenFile:
    where = str(path)
    if size < LLMC_HEADER_BYTES:
        found = f"magic {header[0]}" if len(header) else "the first bytes of an llm.c magic"
        raise UserError(f"{where!r} is {size:,} byte(s), shorter than llm.c's {LLMC_HEADER_BYTES:,}-byte header "
                        f"({found}): a file cut inside its header. {_REFETCH}")
    magic, version, count = (int(x) for x in header[:3])
    if not magic and not version:
        raise UserError(f"{where!r} starts with {LLMC_HEADER_BYTES if not count else 8:,} zero bytes where an llm.c "
                        f"token file has its magic and version: a header zeroed, or a damaged file (read as "
                        f"nanoGPT's raw uint16, the header would be {LLMC_HEADER_BYTES // 2} ids). {_REFETCH}")
    if magic == LLMC_EVAL_MAGIC:
        raise UserError(f"{where!r} is an llm.c eval file (magic {magic}: multiple-choice examples written by "
                        f"write_evalfile, for HellaSwag or MMLU), not a token stream to train on.")
    if (magic, version) not in LLMC_FORMATS:
        raise UserError(f"{where!r} has an llm.c-style header of magic {magic}, version {version}, which is no "
                        f"format meshtrain knows; known: {_KNOWN}. Rewrite it with llm.c's write_datafile, or "
                        f"pass the ids as nanoGPT's raw uint16 (no header).")
    dtype, kind, tokenizer, separator = LLMC_FORMATS[magic, version]
    itemsize = np.dtype(dtype).itemsize
    body = size - LLMC_HEADER_BYTES
    if body != count * itemsize:
        raise UserError(f"{where!r}: its llm.c header (magic {magic}, version {version}) says {count:,} {dtype} "
                        f"ids, {count * itemsize:,} bytes after the header; the file holds {body:,}: "
                        f"{'truncated' if body < count * itemsize else 'longer than its header says'}. {_REFETCH}")
    return TokenFile(path, LLMC_HEADER_BYTES, dtype, count, f"{kind}: header magic {magic}, version {version}, "
                     f"{dtype} ids", tokenizer, separator)


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
    return MegatronFile(path, base, dtype.name, int(starts[-1]), f"Megatron-LM's indexed dataset, {dtype.name} ids",
                        "", "", ends[ends > begins])


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

    def scan(self, eot: int) -> tuple[tuple[int, int], "Ended"]:
        """((its smallest id, its largest); its stream: `eot` inserted after each document not
        ending in it, as Megatron's preprocess_data.py writes them without --append-eod). One
        pass, in pieces."""
        last, span, at = self.ends - 1, (0, -1), 0
        tails = np.empty(len(last), np.int64)  # each document's last id
        for chunk in self.chunks():
            span = _widen(span, chunk)
            i, j = np.searchsorted(last, [at, at + len(chunk)])
            tails[i:j] = chunk[last[i:j] - at]
            at += len(chunk)
        return span, Ended(self, self.ends[tails != eot], eot)


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
