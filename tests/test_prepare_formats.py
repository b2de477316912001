"""`meshtrain prepare` on the corpora people have (meshtrain/data/formats.py, inputs.py):
the same documents as JSON lines (zstd), parquet and a Hugging Face dataset saved to disk
prepare to one token stream; token files made by numpy (nanoGPT's raw uint16, llm.c's
header) prepare to the tokens they hold and train to the losses of the same text, and
Megatron-LM's .bin + .idx to the tokens of the same documents; a compressed or columnar
file is never read as text."""

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import tensorflow_datasets as tfds

from meshtrain.data import token_files
from meshtrain.data.prepare import main as prepare
from meshtrain.data.tokenizers import make_tokenizer
from support.processes import losses

WORDS = "the cat sat on a mat and ate its hat while a dog ran past".split()
FRACTION = 0.1


@pytest.fixture(scope="module")
def documents():
    rng = np.random.default_rng(0)
    return [" ".join(rng.choice(WORDS, rng.integers(3, 30))) for _ in range(200)]


def _stream(data_dir, name: str, split: str) -> np.ndarray:
    ds = tfds.data_source(name, data_dir=str(data_dir))[split]
    return np.concatenate([ds[k]["tokens"] for k in range(len(ds))]).astype(np.int64)


def _write(kind: str, path, docs):
    if kind == "jsonl.zst":
        import zstandard
        lines = "".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(docs))
        path.write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
    elif kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.table({"id": list(range(len(docs))), "text": docs}), path, row_group_size=37)
    else:
        import datasets
        datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(path))
    return path


def test_jsonl_zst_parquet_and_a_saved_hf_dataset_prepare_to_one_token_stream(tmp_path, documents):
    """Each split is its documents in order, each ended by end of text; the held-out ones
    are spread evenly: document i when floor((i+1) f) > floor(i f)."""
    tok = make_tokenizer("byte")
    held = [int(np.floor((i + 1) * FRACTION) > np.floor(i * FRACTION)) for i in range(len(documents))]
    want = {split: np.concatenate([np.append(tok.encode(d), tok.eot_id) for d, h in zip(documents, held)
                                   if h == (split == "validation")]) for split in ("train", "validation")}
    assert sum(held) == len(documents) * FRACTION
    for kind in ("jsonl.zst", "parquet", "hf"):
        source = _write(kind, tmp_path / f"corpus.{kind}", documents)
        name = "c_" + kind.replace(".", "_")
        assert prepare([f"--input={source}", f"--name={name}", f"--data_dir={tmp_path / 'd'}",
                        "--tokenizer=byte", f"--val_fraction={FRACTION}", "--record_tokens=100"]) == 0
        for split in ("train", "validation"):
            np.testing.assert_array_equal(_stream(tmp_path / "d", name, split), want[split], err_msg=kind)
        meta = json.loads((tmp_path / "d" / name / "1.0.0" / "metadata.json").read_text())
        assert meta["num_documents"] == {"train": len(documents) - sum(held), "validation": sum(held)}


def test_val_input_holds_out_its_files_and_text_field_names_the_column(tmp_path, documents):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"body": documents[:150]}), tmp_path / "train.parquet")
    pq.write_table(pa.table({"body": documents[150:]}), tmp_path / "val.parquet")
    assert prepare([f"--input={tmp_path / 'train.parquet'}", f"--val_input={tmp_path / 'val.parquet'}",
                    "--text_field=body", "--name=split", f"--data_dir={tmp_path / 'd'}", "--tokenizer=byte"]) == 0
    tok = make_tokenizer("byte")
    val = _stream(tmp_path / "d", "split", "validation")
    assert tok.decode(val) == "".join(documents[150:]) and np.count_nonzero(val == tok.eot_id) == 50


@pytest.mark.parametrize("header", [False, True], ids=["nanogpt", "llmc"])
def test_token_files_train_to_the_losses_of_the_same_tokens_prepared_from_text(tmp_path, documents, header):
    """The text's two splits, written by numpy as .bin token files (raw uint16, or llm.c's
    256-int32 header first), prepare to the same records, and 3 steps of GPT-2 tiny train to
    the same losses, bit for bit."""
    from meshtrain import train
    (tmp_path / "a.txt").write_text("\n".join(documents))
    data = tmp_path / "d"
    assert prepare([f"--input={tmp_path / 'a.txt'}", "--name=text", f"--data_dir={data}", "--tokenizer=byte"]) == 0
    for split in ("train", "validation"):
        tokens = _stream(data, "text", split).astype(np.uint16)
        with open(tmp_path / f"{split}.bin", "wb") as f:
            if header:
                np.array([token_files.LLMC_MAGIC, 1, len(tokens)] + [0] * 253, np.int32).tofile(f)
            tokens.tofile(f)
    assert prepare([f"--input={tmp_path / 'train.bin'}", f"--val_input={tmp_path / 'validation.bin'}",
                    "--name=bin", f"--data_dir={data}", "--tokenizer=byte"]) == 0
    for split in ("train", "validation"):
        np.testing.assert_array_equal(_stream(data, "bin", split), _stream(data, "text", split))
    runs = {}
    for name in ("text", "bin"):
        work = tmp_path / f"run_{name}"
        assert train.run(["--config=gpt2_tiny_dp8", f"--workdir={work}",
                          "--config.data.kind=tfds", f"--config.data.name={name}", f"--config.data.data_dir={data}",
                          "--config.train.steps=3", "--config.train.log_every=1", "--config.train.eval_every=0",
                          "--config.checkpoint.every=0"]) == 0
        runs[name] = losses(work)
    assert runs["bin"] == runs["text"] and len(runs["text"]) == 3


def _write_megatron(prefix, documents, dtype, code: int | None = None) -> Path:
    """PREFIX.bin and PREFIX.idx as Megatron-core's IndexedDatasetBuilder writes them, byte for
    byte; `documents`: each a list of sequences (id arrays)."""
    sequences = [s for doc in documents for s in doc]
    lengths = np.array([len(s) for s in sequences], np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64)]) * np.dtype(dtype).itemsize
    firsts = np.cumsum([0] + [len(doc) for doc in documents], dtype=np.int64)  # D = documents + 1: 0 ... S
    np.concatenate(sequences).astype(dtype).tofile(f"{prefix}.bin")
    code = code or {np.dtype(np.uint16): 8, np.dtype(np.int32): 4}[np.dtype(dtype)]
    with open(f"{prefix}.idx", "wb") as f:
        f.write(struct.pack("<9sQBQQ", b"MMIDIDX\x00\x00", 1, code, len(lengths), len(firsts)))
        f.write(lengths.astype("<i4").tobytes() + offsets.astype("<i8").tobytes() + firsts.astype("<i8").tobytes())
    return Path(f"{prefix}.bin")


def _megatron_documents(ids, eod: bool, eot: int) -> list:
    """Documents' ids as Megatron's preprocess_data.py stores them: in sentences (here every
    other document in two), end of text after the last under --append-eod; without it, also
    an empty document and one of an empty sentence, which the stream leaves out."""
    docs = [[d[:len(d) // 2], d[len(d) // 2:]] if k % 2 else [d] for k, d in enumerate(ids)]
    if eod:
        return [doc[:-1] + [np.append(doc[-1], eot)] for doc in docs]
    return docs[:5] + [[], [np.zeros(0, np.int64)]] + docs[5:]


@pytest.mark.parametrize("eod", [True, False], ids=["append_eod", "no_eod"])
def test_a_megatron_dataset_prepares_to_the_stream_of_the_same_documents(tmp_path, documents, eod):
    """Megatron-LM's PREFIX.bin + PREFIX.idx (uint16, or int32 ids) prepare to the stream of the
    same documents as JSON lines (with --val_input) and as a nanoGPT .bin (the held-out tail cut
    at an end of text): each document ended by end of text, its own (--append-eod) or inserted."""
    tok, data = make_tokenizer("byte"), tmp_path / "d"
    ids, dtype = [tok.encode(d) for d in documents], np.uint16 if eod else np.int32
    for split, part in (("train", slice(0, 150)), ("val", slice(150, None))):
        _write_megatron(tmp_path / f"m_{split}", _megatron_documents(ids[part], eod, tok.eot_id), dtype)
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents[part]))
    _write_megatron(tmp_path / "m_all", _megatron_documents(ids, eod, tok.eot_id), dtype)
    np.concatenate([np.append(i, tok.eot_id) for i in ids]).astype(np.uint16).tofile(tmp_path / "all.bin")
    inputs = {"jsonl": ("train.jsonl", "val.jsonl"), "megatron_val": ("m_train.bin", "m_val.bin"),
              "nanogpt": ("all.bin", ""), "megatron": ("m_all.bin", "")}
    for name, (train, val) in inputs.items():
        assert prepare([f"--input={tmp_path / train}", *([f"--val_input={tmp_path / val}"] if val else []),
                        f"--name={name}", f"--data_dir={data}", "--tokenizer=byte", f"--val_fraction={FRACTION}",
                        "--record_tokens=100"]) == 0
    for split in ("train", "validation"):
        np.testing.assert_array_equal(_stream(data, "megatron_val", split), _stream(data, "jsonl", split))
        np.testing.assert_array_equal(_stream(data, "megatron", split), _stream(data, "nanogpt", split))
    meta = {name: json.loads((data / name / "1.0.0" / "metadata.json").read_text()) for name in inputs}
    assert meta["megatron_val"]["num_documents"] == meta["jsonl"]["num_documents"] == {"train": 150, "validation": 50}


def test_a_megatron_stream_reads_any_range_with_its_ends_of_text(tmp_path):
    """A piece of the stream, read from anywhere in pieces of any size, is that piece of the
    whole: a document keeps its own end of text, one without gets one after it."""
    eot, rng = 9, np.random.default_rng(1)
    ids = [rng.integers(0, eot, rng.integers(1, 6)) for _ in range(30)]
    ids = [np.append(d, eot) if k % 3 == 0 else d for k, d in enumerate(ids)]
    whole = np.concatenate([d if d[-1] == eot else np.append(d, eot) for d in ids])
    (low, top), stream = token_files.token_file(_write_megatron(tmp_path / "m", _megatron_documents(ids, False, eot),
                                                                np.uint16)).scan(eot)
    assert (low, top) == (0, eot) and stream.count == len(whole)
    ends = np.flatnonzero(whole == eot)  # ranges from and around ends of text, their own or inserted
    ranges = [(0, len(whole)), *((e, e + 1) for e in ends), *((e, len(whole)) for e in ends),
              *(sorted(rng.integers(0, len(whole) + 1, 2)) for _ in range(40))]
    for a, b in ranges:
        for size in (1, 3, 64):
            got = list(stream.chunks(a, b, size))
            np.testing.assert_array_equal(np.concatenate(got) if got else [], whole[a:b])


def test_a_damaged_megatron_dataset_is_named_with_the_fix(tmp_path, capsys):
    good = _write_megatron(tmp_path / "good", [[np.arange(5)], [np.arange(3), np.arange(4)]], np.uint16)
    idx, ids = good.with_suffix(".idx").read_bytes(), good.read_bytes()
    cases = {"magic": (b"MMIDIDY\x00\x00" + idx[9:], ids,
                       "starts b'MMIDIDY\\x00\\x00', not b'MMIDIDX\\x00\\x00': not a Megatron-LM index"),
             "short": (idx, ids[:-2],
                       "its index says 12 uint16 ids from byte 0, 24 bytes; the .bin holds 22: truncated"),
             "cut": (idx[:-8], ids, "where its 3 sequences and 3 document indices take 94: truncated"),
             "float": (idx[:17] + bytes([7]) + idx[18:], ids, "dtype code 7 (float32), not token ids")}
    for name, (index, content, want) in cases.items():
        (tmp_path / f"{name}.idx").write_bytes(index)
        (tmp_path / f"{name}.bin").write_bytes(content)
        assert prepare([f"--input={tmp_path / name}.bin", "--name=x", f"--data_dir={tmp_path / 'd'}"]) == 2
        err = capsys.readouterr().err
        assert want in err and "preprocess_data.py" in err and "Traceback" not in err, err


def test_a_compressed_or_columnar_file_is_never_read_as_text(tmp_path, documents, capsys):
    parquet = _write("parquet", tmp_path / "c.parquet", documents)
    zst = _write("jsonl.zst", tmp_path / "c.jsonl.zst", documents)
    zst_as_txt = tmp_path / "c.txt"
    zst_as_txt.write_bytes(zst.read_bytes())
    for args, what in (([f"--input={parquet}", "--format=text"], "is a parquet file"),
                       ([f"--input={zst_as_txt}"], "is zstd-compressed")):
        assert prepare([*args, "--name=x", f"--data_dir={tmp_path / 'd'}"]) == 2
        err = capsys.readouterr().err
        assert what in err and "not text" in err and "Traceback" not in err


def test_bad_records_are_named_with_the_fix(tmp_path, capsys):
    cases = {"nofield.jsonl": '{"body": "a"}\n', "broken.jsonl": '{"text": "a"}\n{"text": \n',
             "odd.bin": "abc", "alone.idx": "MMIDIDX"}
    want = {"nofield.jsonl": "line 1: no field 'text' (it has ['body']). Pass --text_field=NAME.",
            "broken.jsonl": "line 2: not JSON (Expecting value at column 11)", "odd.bin": "odd number of bytes",
            "alone.idx": "is a Megatron-LM index, read with its .bin: name the .bin files"}
    for name, content in cases.items():
        (tmp_path / name).write_text(content)
        assert prepare([f"--input={tmp_path / name}", "--name=x", f"--data_dir={tmp_path / 'd'}"]) == 2
        err = capsys.readouterr().err
        assert want[name] in err and "Traceback" not in err, err


def _llama3_tokenizer(folder) -> str:
    """hf:DIR of a tokenizer laid out as Llama 3's: 128,000 tiktoken ranks, then its 256 special
    tokens (<|begin_of_text|> 128,000, <|end_of_text|> 128,001): 128,256 ids."""
    import base64
    folder.mkdir()
    ranks = [bytes([b]) for b in range(256)] + [bytes([a, b, c]) for a in range(1, 3) for b in range(256)
                                                for c in range(256)][:128000 - 256]
    lines = (f"{base64.b64encode(r).decode()} {i}\n" for i, r in enumerate(ranks))
    (folder / "tokenizer.model").write_text("".join(lines))
    return f"hf:{folder}"


def test_an_llmc_llama3_file_prepares_to_its_ids_and_another_vocabulary_is_refused_naming_its_header(tmp_path, capsys):
    """llm.c's write_datafile(..., "llama-3"): 256 int32 (20240801, 7, count, zeros), then uint32
    ids, <|begin_of_text|> (128,000) before each document (dev/data/*.py). With a 128,256-id
    tokenizer it prepares to exactly its ids, the held-out split cut at a document's start;
    with GPT-2's it is refused naming the header and the ids' range, not the tokenizer passed."""
    from support.tokenizer_files import fake_gpt2_dir
    rng = np.random.default_rng(3)
    docs = [rng.integers(0, 128000, rng.integers(5, 60)) for _ in range(120)]
    docs[7][0] = 127999  # ids past uint16's
    stream = np.concatenate([np.concatenate([[128000], d]) for d in docs]).astype(np.uint32)
    header = np.zeros(256, np.int32)
    header[:3] = 20240801, 7, len(stream)
    (tmp_path / "llama.bin").write_bytes(header.tobytes() + stream.tobytes())
    llama, data = _llama3_tokenizer(tmp_path / "llama3"), tmp_path / "d"
    assert prepare([f"--input={tmp_path / 'llama.bin'}", "--name=l3", f"--data_dir={data}", f"--tokenizer={llama}",
                    f"--val_fraction={FRACTION}", "--record_tokens=100"]) == 0
    train, val = _stream(data, "l3", "train"), _stream(data, "l3", "validation")
    np.testing.assert_array_equal(np.concatenate([train, val]), stream)
    assert train[-1] == 128000 and len(val) < len(stream) * (FRACTION + 0.05)  # cut after a separator near 1 - f
    meta = json.loads((data / "l3" / "1.0.0" / "metadata.json").read_text())
    # a document is a run between separators: train ends with the separator that leads validation's first
    assert meta["num_documents"] == {"train": np.count_nonzero(train == 128000) - 1,
                                     "validation": np.count_nonzero(val == 128000) + 1}
    gpt2 = f"gpt2:{fake_gpt2_dir(tmp_path)[0]}"
    assert prepare([f"--input={tmp_path / 'llama.bin'}", "--name=g", f"--data_dir={data}", f"--tokenizer={gpt2}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "llm.c's Llama 3 format: header magic 20240801, version 7, uint32 ids" in err, err
    assert f"holds ids {int(stream.min()):,} to 128,000" in err and "--tokenizer=hf:DIR" in err, err
    assert "--tokenizer=gpt2" not in err and err.count("262 ids") == 1, err


def test_an_empty_split_is_refused_at_prepare_naming_its_input_and_at_train_in_one_line(tmp_path, documents, capsys):
    from meshtrain import train
    from meshtrain.data.token_dataset import write_token_dataset
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "val.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents[:20]))
    (tmp_path / "empty.bin").write_bytes(b"")
    np.arange(50, dtype=np.uint16).tofile(tmp_path / "val.bin")
    cases = {("empty.jsonl", "val.jsonl"): "--input '{}' (1 file(s) of jsonl) holds no document with text",
             ("val.jsonl", "empty.jsonl"): "--val_input '{}' (1 file(s)) holds no document with text",
             ("empty.bin", "val.bin"): "--input '{}' holds no token ids",
             ("val.bin", "empty.bin"): "--val_input '{}' holds no token ids"}
    for (train_file, val_file), want in cases.items():
        assert prepare([f"--input={tmp_path / train_file}", f"--val_input={tmp_path / val_file}", "--name=x",
                        f"--data_dir={tmp_path / 'd'}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        empty = train_file if want.startswith("--input") else val_file
        assert want.format(tmp_path / empty) in err[-1] and "Traceback" not in "".join(err), err
    tok = make_tokenizer("byte")
    write_token_dataset("hollow", tmp_path / "d", tok, {"train": lambda: [tok.encode("a" * 500)],
                                                        "validation": lambda: []})
    assert train.main(["--config=gpt2_tiny_dp8", "--config.data.kind=tfds", "--config.data.name=hollow",
                       f"--config.data.data_dir={tmp_path / 'd'}", "--config.train.steps=1"]) == 2
    err = capsys.readouterr().err
    assert "split 'validation' holds no tokens" in err and "Traceback" not in err, err
