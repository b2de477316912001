"""A small corpus in every input format `meshtrain prepare` reads, written the way the
format's usual writer does, and the ways a copy of it gets damaged
(tests/test_prepare_damage.py).

`write(fmt, folder, documents)` -> (the --input path, where its blocks end: byte offsets
of each file where the writer closed a frame block, deflate block, row group, record
batch or sequence). `damages(fmt, folder, ends, rng)` -> [(kind, label, apply)], each
`apply(folder)` damaging a copy of the folder in place:

    truncate   the file cut at a block end and at sampled bytes
    flip       one byte XOR 0x01-0x80, at sampled bytes of the part the format checks
    zero       the header zeroed
    empty      the file made 0 bytes
    drop       a sibling file (index, shard, listing) removed

Only damage the format can tell is made: plain JSON lines cut at a line break, raw
uint16 ids cut anywhere, or bytes flipped inside text and ids that no checksum covers,
read as another valid file by any reader. NOT_CHECKED says which, for the table.
"""

from __future__ import annotations

import gzip
import json
import zlib
from pathlib import Path

import numpy as np

FORMATS = ("jsonl", "jsonl.gz", "jsonl.zst", "parquet", "hf", "llmc_gpt2", "llmc_llama3", "nanogpt", "megatron")
PER_BLOCK = 40  # documents a writer puts in one block
NOT_CHECKED = {
    "jsonl": "a cut at a line break; flips in the text (no checksum, no length)",
    "jsonl.gz": "a cut between members of a several-member file (each member is whole)",
    "jsonl.zst": "a cut between frames of a several-frame file (each frame is whole)",
    "parquet": "flips in pages written without CRCs (pyarrow's default)",
    "hf": "flips in the strings' bytes (Arrow carries no checksum)",
    "llmc_gpt2": "flips in the ids (no checksum)", "llmc_llama3": "flips in the ids (no checksum)",
    "nanogpt": "any cut at an even byte, any flip (no header, no checksum)",
    "megatron": "flips in the ids and in the index's document boundaries (no checksum)",
}


def _lines(documents) -> list[bytes]:
    return [(json.dumps({"id": i, "text": d}) + "\n").encode() for i, d in enumerate(documents)]


def _blocks(items: list, size: int = PER_BLOCK) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def write(fmt: str, folder: Path, documents: list[str], ids: list[np.ndarray], eot: int,
          bos: int | None = None) -> tuple[Path, dict]:
    """The corpus in `fmt` under `folder`; `ids` are the documents' token ids (token formats),
    `eot` and `bos` the tokenizer's end of text and <|begin_of_text|> (llm.c's Llama 3 files
    lead each document with it). -> (--input, {file name: [byte offsets where a block ends]})."""
    folder.mkdir(parents=True, exist_ok=True)
    if fmt == "jsonl":
        lines = _lines(documents)
        (folder / "c.jsonl").write_bytes(b"".join(lines))
        return folder / "c.jsonl", {"c.jsonl": list(np.cumsum([len(x) for x in lines]))}
    if fmt == "jsonl.gz":  # a deflate block closed every PER_BLOCK lines (a sync flush)
        ends = []
        with open(folder / "c.jsonl.gz", "wb") as raw:
            with gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
                for block in _blocks(_lines(documents)):
                    f.write(b"".join(block))
                    f.flush(zlib.Z_FULL_FLUSH)
                    ends.append(raw.tell())
        return folder / "c.jsonl.gz", {"c.jsonl.gz": ends}
    if fmt == "jsonl.zst":  # one frame with its content size and checksum, as the zstd tool writes
        import zstandard
        data = _blocks(_lines(documents))
        c = zstandard.ZstdCompressor(write_checksum=True).compressobj(size=sum(len(x) for b in data for x in b))
        out, ends = b"", []
        for block in data:
            out += c.compress(b"".join(block)) + c.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)
            ends.append(len(out))
        out += c.flush()
        (folder / "c.jsonl.zst").write_bytes(out)
        return folder / "c.jsonl.zst", {"c.jsonl.zst": ends + [len(out)]}
    if fmt == "parquet":  # page CRCs written, so flips in the pages can be told
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.table({"id": list(range(len(documents))), "text": documents}), folder / "c.parquet",
                       row_group_size=PER_BLOCK, write_page_checksum=True)
        meta = pq.ParquetFile(folder / "c.parquet").metadata
        starts = [meta.row_group(g).column(0).file_offset for g in range(meta.num_row_groups)]
        return folder / "c.parquet", {"c.parquet": [int(s) for s in starts]}
    if fmt == "hf":  # datasets' own save_to_disk, in two shards of record batches
        import datasets
        datasets.Dataset.from_dict({"text": documents}).save_to_disk(str(folder / "saved"), num_shards=2)
        return folder / "saved", {a.name: _batch_ends(a) for a in sorted((folder / "saved").glob("*.arrow"))}
    if fmt in ("llmc_gpt2", "llmc_llama3", "nanogpt"):
        # llm.c's stream: end of text before each document (write_datafile); nanoGPT's after
        lead = bos if fmt == "llmc_llama3" else eot
        stream = np.concatenate([np.concatenate([[lead], d]) if fmt != "nanogpt" else np.append(d, eot) for d in ids])
        dtype = np.uint32 if fmt == "llmc_llama3" else np.uint16
        magic = {"llmc_gpt2": [20240520, 1], "llmc_llama3": [20240801, 7]}.get(fmt)  # write_datafile's
        header = b"" if magic is None else np.array(magic + [len(stream)] + [0] * 253, np.int32).tobytes()
        (folder / "c.bin").write_bytes(header + stream.astype(dtype).tobytes())
        size = np.dtype(dtype).itemsize
        lengths = np.cumsum([len(d) + 1 for d in ids]) * size + len(header)
        return folder / "c.bin", {"c.bin": [len(header)] + [int(x) for x in lengths[PER_BLOCK - 1::PER_BLOCK]]}
    if fmt == "megatron":  # preprocess_data.py's names and bytes, with --append-eod
        seqs = [np.append(d, eot).astype(np.uint16) for d in ids]
        lengths = np.array([len(s) for s in seqs], np.int32)
        offsets = np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64)]) * 2
        (folder / "c_text_document.bin").write_bytes(np.concatenate(seqs).tobytes())
        import struct
        with open(folder / "c_text_document.idx", "wb") as f:
            f.write(struct.pack("<9sQBQQ", b"MMIDIDX\x00\x00", 1, 8, len(lengths), len(lengths) + 1))
            f.write(lengths.astype("<i4").tobytes() + offsets.astype("<i8").tobytes()
                    + np.arange(len(lengths) + 1, dtype="<i8").tobytes())
        return folder / "c_text_document.bin", {
            "c_text_document.bin": [int(x) for x in (offsets[1:] if len(offsets) > 1 else [])][::PER_BLOCK],
            "c_text_document.idx": [34, 34 + 4 * len(lengths), 34 + 12 * len(lengths)]}
    raise ValueError(fmt)


def _batch_ends(arrow: Path) -> list[int]:
    """Where each message of an Arrow stream ends (schema, record batches), by reading it."""
    import pyarrow as pa
    ends = []
    with pa.memory_map(str(arrow)) as source:
        reader = pa.ipc.open_stream(source)
        ends.append(source.tell())
        for _ in reader:
            ends.append(source.tell())
    return ends


def _checked_region(fmt: str, name: str, size: int) -> tuple[int, int]:
    """[a, b): the bytes of file `name` its format can tell a flip in."""
    if fmt in ("jsonl.gz", "jsonl.zst", "parquet") or name == "state.json":
        return 0, size  # a checksum over the content; the rest is structure
    if fmt.startswith("llmc"):
        return 0, 12  # magic, version, count (llm.c reads no more of the header)
    if name.endswith(".idx"):
        return 0, 34 + 12 * ((size - 42) // 20)  # the header, lengths and offsets; not the documents
    if name.endswith(".arrow"):
        return 0, 8  # the stream's first message header
    return 0, 0


def damages(fmt: str, root: Path, ends: dict, rng: np.random.Generator, samples: int = 8) -> list[tuple]:
    """[(kind, label, apply(folder))] for a corpus written by `write` into `root` (module
    docstring); `apply` damages a copy of `root`."""
    out = []
    for name, blocks in ends.items():
        path = next(root.rglob(name))
        rel, size = path.relative_to(root), path.stat().st_size
        cuts = {b for b in blocks if 0 < b < size} | {int(x) for x in rng.integers(1, size, samples)} | {1, size - 1}
        if fmt == "jsonl":  # a cut at a line break is a whole file of fewer lines
            cuts -= set(blocks) | {size}
            text = path.read_bytes()
            cuts = {c for c in cuts if text[c - 1:c] != b"\n"}
        if fmt == "nanogpt":
            cuts = {c for c in cuts if c % 2}
        for cut in sorted(cuts):
            out.append(("truncate", f"{rel} at {cut}/{size}" + (" (block end)" if cut in blocks else ""),
                        lambda d, rel=rel, cut=cut: _truncate(d / rel, cut)))
        a, b = _checked_region(fmt, name, size)
        if b > a:
            for at in sorted(set(int(x) for x in rng.integers(a, b, samples)) | {a, b - 1}):
                bit = 1 << int(rng.integers(0, 8))
                out.append(("flip", f"{rel} byte {at} ^ {bit:#04x}",
                            lambda d, rel=rel, at=at, bit=bit: _flip(d / rel, at, bit)))
        header = _HEADER.get(Path(name).suffix, _HEADER.get(fmt, 0))
        if header:
            out.append(("zero", f"{rel} first {header} bytes", lambda d, rel=rel, n=header: _zero(d / rel, n)))
        out.append(("empty", f"{rel} made empty", lambda d, rel=rel: (d / rel).write_bytes(b"")))
    if fmt == "hf":
        for sibling in ("state.json", "dataset_info.json", sorted(ends)[-1]):
            out.append(("drop", f"saved/{sibling}", lambda d, s=sibling: (d / "saved" / s).unlink()))
        state = root / "saved" / "state.json"
        out.append(("flip", "saved/state.json: a file name changed",
                    lambda d: (d / "saved" / "state.json").write_text(state.read_text().replace("-of-", "-0f-", 1))))
    if fmt == "megatron":
        for sibling in ("c_text_document.idx", "c_text_document.bin"):
            out.append(("drop", sibling, lambda d, s=sibling: (d / s).unlink()))
    return out


# the bytes "zero" damages: by file suffix, else by format
_HEADER = {".idx": 34, ".arrow": 8,
           "jsonl.gz": 10, "jsonl.zst": 6, "parquet": 4, "llmc_gpt2": 1024, "llmc_llama3": 1024}


def _truncate(path: Path, n: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(n)


def _flip(path: Path, at: int, bit: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= bit
    path.write_bytes(bytes(data))


def _zero(path: Path, n: int) -> None:
    data = bytearray(path.read_bytes())
    data[:n] = bytes(min(n, len(data)))
    path.write_bytes(bytes(data))
