"""`meshtrain prepare` on the corpora people have (meshtrain/data/formats.py, inputs.py):
the same documents as JSON lines (zstd), parquet and a Hugging Face dataset saved to disk
prepare to one token stream; token files made by numpy (nanoGPT's raw uint16, llm.c's
header) prepare to the tokens they hold and train to the losses of the same text; a
compressed or columnar file is never read as text."""

import json

import numpy as np
import pytest
import tensorflow_datasets as tfds

from meshtrain.data import formats
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
                np.array([formats.LLMC_MAGIC, 1, len(tokens)] + [0] * 253, np.int32).tofile(f)
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
             "odd.bin": "abc"}
    want = {"nofield.jsonl": "line 1: no field 'text' (it has ['body']). Pass --text_field=NAME.",
            "broken.jsonl": "line 2: not JSON", "odd.bin": "odd number of bytes"}
    for name, content in cases.items():
        (tmp_path / name).write_text(content)
        assert prepare([f"--input={tmp_path / name}", "--name=x", f"--data_dir={tmp_path / 'd'}"]) == 2
        err = capsys.readouterr().err
        assert want[name] in err and "Traceback" not in err, err
