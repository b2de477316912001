"""`meshtrain prepare --workers`: units tokenized in worker processes give the dataset one
process gives, byte for byte; a prepare killed part way (SIGKILL) and rerun keeps the units
it finished and ends with the dataset of an unbroken run; data.kind=text sends a corpus it
should not tokenize at every start to prepare (meshtrain/data/tokenize_pool.py)."""

import json
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow_datasets as tfds

from meshtrain.data.prepare import main as prepare
from meshtrain.errors import UserError

WORDS = "the cat sat on a mat and ate its hat while a dog ran past".split()


def _corpus(root, files: int, docs: int, seed: int = 0):
    """`files` .jsonl files of `docs` short documents each."""
    rng = np.random.default_rng(seed)
    root.mkdir()
    for i in range(files):
        lines = (json.dumps({"text": " ".join(rng.choice(WORDS, rng.integers(3, 12)))}) for _ in range(docs))
        (root / f"part-{i:02d}.jsonl").write_text("\n".join(lines) + "\n")
    return root


def _files(dataset) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(dataset.iterdir())}


def test_workers_write_the_dataset_one_process_writes(tmp_path):
    corpus = _corpus(tmp_path / "in", files=5, docs=300)
    text = tmp_path / "t.txt"
    text.write_text("".join(f"line {i} of the text\n" for i in range(3000)))
    for source, name in ((f"{corpus}/*.jsonl", "records"), (str(text), "text")):
        for workers in (1, 2):
            assert prepare([f"--input={source}", f"--name={name}{workers}", f"--data_dir={tmp_path / 'd'}",
                            "--tokenizer=byte", f"--workers={workers}", "--record_tokens=512"]) == 0
        one, two = (_files(tmp_path / "d" / f"{name}{w}" / "1.0.0") for w in (1, 2))
        rename = {k.replace(f"{name}1", f"{name}2"): v for k, v in one.items()}
        assert rename.keys() == two.keys()
        for k in two:  # the records and the token counts; the dataset's name differs in the metadata
            if k.endswith("array_record-00000-of-00001") or k == "tokenizer.json":
                assert rename[k] == two[k], (name, k)
        assert not (tmp_path / "d" / f".{name}2.prepare").exists(), "the work directory is removed at the end"


def test_a_killed_prepare_rerun_ends_with_the_dataset_of_an_unbroken_run(tmp_path):
    corpus = _corpus(tmp_path / "in", files=8, docs=6_000)
    args = [f"--input={corpus}/*.jsonl", "--name=c", "--tokenizer=byte", "--workers=1"]
    assert prepare([*args, f"--data_dir={tmp_path / 'whole'}"]) == 0
    work = tmp_path / "cut" / ".c.prepare"
    proc = subprocess.Popen([sys.executable, "-m", "meshtrain", "prepare", *args, f"--data_dir={tmp_path / 'cut'}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not list(work.glob("unit-*.done")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = len(list(work.glob("unit-*.done")))
    assert 0 < done < 8, f"killed with {done} of 8 units done: the test needs a prepare cut part way"
    assert not (tmp_path / "cut" / "c").exists()
    out = subprocess.run([sys.executable, "-m", "meshtrain", "prepare", *args, f"--data_dir={tmp_path / 'cut'}"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert f"{done} done by an earlier run, kept" in out.stderr
    assert _files(tmp_path / "cut" / "c" / "1.0.0") == _files(tmp_path / "whole" / "c" / "1.0.0")


def test_data_kind_text_sends_records_and_large_corpora_to_prepare(tmp_path, monkeypatch):
    from meshtrain.data import text
    corpus = _corpus(tmp_path / "in", files=1, docs=10)
    big = tmp_path / "big.txt"
    big.write_text("x" * 4096)
    monkeypatch.setattr(text, "TEXT_LIMIT", 1024)
    for path, what in ((corpus / "part-00.jsonl", "holds jsonl files: prepare them once: meshtrain prepare"),
                       (big, "more than data.kind=text tokenizes at every start (0 MiB)")):
        with pytest.raises(UserError) as e:
            text.make_text_source(str(path), tokenizer="byte", val_fraction=0.1, seq_len=8, seed=0)
        assert what in str(e.value) and "--config.data.kind=tfds" in str(e.value)


def test_token_records_are_the_bytes_tfds_serializes():
    """A record is token_dataset.record_header for its length, then the ids (what prepare's
    workers write); what TFDS's own features would write, so tfds.data_source decodes it."""
    from meshtrain.data import token_dataset
    rng = np.random.default_rng(0)
    for dtype in (np.uint16, np.int32):
        features = token_dataset.token_features(np.dtype(dtype))
        for n in (0, 1, 4095, 4096):
            tokens = rng.integers(0, 50257, n).astype(dtype)
            record = token_dataset.record_header(tokens.nbytes) + tokens.tobytes()
            assert record == features.serialize_example({"tokens": tokens})


def test_shards_are_written_as_units_finish_and_a_stop_keeps_them(tmp_path):
    """The dataset's shards are written as soon as the units they read are done, into the
    work directory; a unit's ids are deleted once every shard reading them is written; a
    prepare stopped part way and rerun writes only what is left, without the freed units,
    and ends with the files of an unbroken run."""
    from meshtrain.data import inputs, token_shards, tokenize_pool
    from meshtrain.data.tokenizers import make_tokenizer
    from meshtrain.progress import Progress
    corpus = inputs.Records(f"{_corpus(tmp_path / 'in', files=6, docs=800)}/*.jsonl", "jsonl", "text",
                            val_fraction=0.1)
    tok, units = make_tokenizer("byte"), corpus.units()

    class Stop(Progress):
        """The tokenize bar, which stops the prepare (as Ctrl-C would) once `units` units are done."""

        def __init__(self, units=None):
            super().__init__("tokenize", 1)
            self.units = units

        def update(self, n):
            if self.units and sum((work / f"unit-{k}.done").exists() for k in range(len(units))) >= self.units:
                raise KeyboardInterrupt

    def write(data_dir, bar):
        w = tokenize_pool.Work(tmp_path / f"work-{data_dir}", {"plan": 1})
        tok.save(w.root / "tokenizer.json")
        return token_shards.write("c", tmp_path / data_dir, tok, corpus, units, w, None, workers=1, fraction=0.1,
                                  record_tokens=256, tokenize_bar=bar, shard_bytes=4096)

    work = tmp_path / "work-whole"
    write("whole", Stop())
    assert len(list((tmp_path / "whole" / "c" / "1.0.0").glob("*train.array_record-*"))) > 20
    docs = [json.loads(line)["text"] for f in sorted((tmp_path / "in").glob("*.jsonl")) for line in f.open()]
    held = [np.floor((i + 1) * 0.1) > np.floor(i * 0.1) for i in range(len(docs))]
    for split in ("train", "validation"):  # each split's documents in order, across shards and units
        want = np.concatenate([np.append(tok.encode(d), tok.eot_id) for d, h in zip(docs, held)
                               if h == (split == "validation")])
        got = tfds.data_source("c", data_dir=str(tmp_path / "whole"))[split]
        np.testing.assert_array_equal(np.concatenate([got[k]["tokens"] for k in range(len(got))]), want)
    work = tmp_path / "work-cut"
    with pytest.raises(KeyboardInterrupt):
        write("cut", Stop(units=3))
    written = len(list((work / "shards").glob("*.done")))
    done = [k for k in range(len(units)) if (work / f"unit-{k}.done").exists()]
    freed = [k for k in done if not (work / f"unit-{k}.tokens").exists()]
    assert len(done) < len(units) and written > 0 and 0 < len(freed) < len(done), (done, written, freed)
    assert not (tmp_path / "cut" / "c" / "1.0.0").exists()
    write("cut", Stop())
    assert _files(tmp_path / "cut" / "c" / "1.0.0") == _files(tmp_path / "whole" / "c" / "1.0.0")


def test_units_held_out_per_document_are_freed_as_fast_as_the_training_shards_read_them(tmp_path):
    """A validation shard of documents held out per document holds the held-out share of a
    training shard's tokens, so it spans the units a training shard does: a unit's ids wait
    on disk for the next shards only, not for one validation shard that spans 1 / fraction
    of the units (here every one)."""
    from meshtrain.data import inputs, token_shards, tokenize_pool
    from meshtrain.data.tokenizers import make_tokenizer
    from meshtrain.progress import Progress
    corpus = inputs.Records(f"{_corpus(tmp_path / 'in', files=20, docs=40)}/*.jsonl", "jsonl", "text",
                            val_fraction=0.1)
    tok, units, work = make_tokenizer("byte"), corpus.units(), tokenize_pool.Work(tmp_path / "work", {"plan": 1})
    tok.save(work.root / "tokenizer.json")
    on_disk = []

    class Count(Progress):
        def update(self, n):  # after each unit: how many units' ids are on disk
            on_disk.append(len(list(work.root.glob("unit-*.tokens"))))

    meta = token_shards.write("c", tmp_path / "d", tok, corpus, units, work, None, workers=1, fraction=0.1,
                              record_tokens=256, tokenize_bar=Count("tokenize", 1), shard_bytes=4096)
    assert token_shards.shard_tokens(units, 0.1, 2048, 256) == {"train": 2048, "validation": 256}
    assert token_shards.shard_tokens(units[:1], 0.0, 2048, 256)["validation"] == 2048
    shards = sorted((tmp_path / "d" / "c" / "1.0.0").glob("*validation.array_record-*"))
    assert len(shards) == -(-meta["num_tokens"]["validation"] // 256)  # one record each
    assert max(on_disk) <= 5, on_disk  # full-size validation shards keep every unit: 20 at the end


def test_a_large_jsonl_file_is_cut_into_units_of_lines(tmp_path, monkeypatch, capsys):
    """A plain .jsonl file past formats.UNIT_BYTES is cut into units that end after a line
    break: the dataset is the one whole-file units give, byte for byte, and a bad line in
    a later unit is named by its line in the file."""
    from meshtrain.data import formats, inputs
    corpus = _corpus(tmp_path / "in", files=2, docs=700)
    args = [f"--input={corpus}/*.jsonl", "--tokenizer=byte", "--record_tokens=512"]
    assert prepare([*args, "--name=whole", f"--data_dir={tmp_path / 'd'}"]) == 0
    monkeypatch.setattr(formats, "UNIT_BYTES", 2000)
    units = inputs.Records(f"{corpus}/*.jsonl", "jsonl", "text", val_fraction=0.1).units()
    assert len(units) > 20 and all(u.where[1] == 0 or (corpus / "part-00.jsonl").read_bytes()[u.where[1] - 1:u.where[1]]
                                   in (b"\n", b"") for u in units if u.where[0].endswith("part-00.jsonl"))
    assert prepare([*args, "--name=cut", f"--data_dir={tmp_path / 'd'}", "--workers=2"]) == 0
    whole, cut = (_files(tmp_path / "d" / name / "1.0.0") for name in ("whole", "cut"))
    for k in whole:  # the records; the dataset's name differs in the metadata
        if ".array_record-" in k:
            assert whole[k] == cut[k.replace("whole", "cut")], k
    lines = (corpus / "part-01.jsonl").read_text().splitlines()
    lines[600] = "{not json"
    (corpus / "part-01.jsonl").write_text("\n".join(lines) + "\n")
    assert prepare([*args, "--name=bad", f"--data_dir={tmp_path / 'd'}"]) == 2
    assert "part-01.jsonl' line 601: not JSON" in capsys.readouterr().err
