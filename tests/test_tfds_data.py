"""TFDS token datasets: prepare, read back, equal the in-memory text source, other
TFDS datasets tokenized once, two processes reading disjoint shards, and errors."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import ml_collections
import numpy as np
import pytest
import tensorflow_datasets as tfds

from meshtrain.data import catalog, make_source
from meshtrain.data.prepare import main as prepare
from meshtrain.data.tokenizers import load_tokenizer
from meshtrain.errors import UserError
from support.processes import free_port

SEQ = 16
ROOT = Path(__file__).resolve().parents[1]
CORPUS = "".join(f"Line {i}: the quick brown fox jumps over {i * 7 % 13} lazy dogs.\n"
                 for i in range(400))


def _cfg(**kw):
    base = dict(kind="tfds", path="", tokenizer="byte", name="corpus", data_dir="",
                split="train", eval_split="validation", feature="", cache_dir="",
                val_fraction=0.1, random_offsets=False)
    base.update(kw)
    return ml_collections.ConfigDict(base)


def _prepare(tmp, *args, text=CORPUS, name="corpus"):
    (tmp / "in").mkdir(exist_ok=True)
    (tmp / "in" / "a.txt").write_text(text, encoding="utf-8")
    return prepare([f"--input={tmp / 'in' / 'a.txt'}", f"--name={name}",
                    f"--data_dir={tmp / 'd'}", "--val_fraction=0.1", *args])


@pytest.fixture(scope="module")
def char_dataset(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("char")
    assert _prepare(tmp, "--tokenizer=char", "--record_tokens=100") == 0
    return tmp


def _take(it, n):
    return [next(it) for _ in range(n)]


def test_prepared_dataset_is_plain_tfds(char_dataset):
    out = char_dataset / "d" / "corpus" / "1.0.0"
    assert {"dataset_info.json", "features.json", "metadata.json", "tokenizer.json"} <= {
        p.name for p in out.iterdir()}
    meta = json.loads((out / "metadata.json").read_text())
    tok = load_tokenizer(out / "tokenizer.json")
    assert meta["format"] == "meshtrain.tokens/1" and meta["vocab_size"] == tok.vocab_size
    ds = tfds.data_source("corpus", data_dir=str(char_dataset / "d"))
    # The train stream is the corpus head plus end of text, stored 100 tokens a record.
    train = np.concatenate([ds["train"][k]["tokens"] for k in range(len(ds["train"]))])
    assert len(train) == meta["num_tokens"]["train"] and len(ds["train"]) == -(-len(train) // 100)
    assert train[-1] == tok.eot_id and tok.decode(train) == CORPUS[: len(train) - 1]
    val = np.concatenate([ds["validation"][k]["tokens"] for k in range(len(ds["validation"]))])
    assert tok.decode(val) == CORPUS[len(train) - 1:]
    assert CORPUS[len(train) - 2] == "\n"  # held out from a line break


@pytest.mark.parametrize("random_offsets", [False, True])
def test_tfds_windows_equal_the_text_source(char_dataset, random_offsets):
    kw = dict(tokenizer="char", random_offsets=random_offsets)
    from_tfds = make_source(_cfg(data_dir=str(char_dataset / "d"), **kw),
                            vocab_size=-1, seq_len=SEQ, seed=5)
    from_text = make_source(_cfg(kind="text", path=str(char_dataset / "in" / "a.txt"), **kw),
                            vocab_size=-1, seq_len=SEQ, seed=5)
    assert from_tfds.vocab_size == from_text.vocab_size
    for a, b in zip(_take(from_tfds.train_batches(8), 30), _take(from_text.train_batches(8), 30)):
        np.testing.assert_array_equal(a, b)  # 30 batches span an epoch boundary
    for a, b in zip(from_tfds.eval_batches(8, 3), from_text.eval_batches(8, 3)):
        np.testing.assert_array_equal(a, b)
    assert from_tfds.info["train_tokens"] == from_text.info["train_tokens"]


def test_doc_separator_makes_documents(tmp_path):
    text = "".join(f"paragraph {i}\nstill paragraph {i}\n\n" for i in range(30))
    assert _prepare(tmp_path, "--doc_separator=\\n\\n", text=text) == 0
    meta = json.loads((tmp_path / "d" / "corpus" / "1.0.0" / "metadata.json").read_text())
    assert sum(meta["num_documents"].values()) in (30, 31)  # the cut may split one in two
    ds = tfds.data_source("corpus", data_dir=str(tmp_path / "d"))
    train = np.concatenate([ds["train"][k]["tokens"] for k in range(len(ds["train"]))])
    assert (train == 256).sum() == meta["num_documents"]["train"]
    assert b"\n\n" not in bytes(train[train < 256].astype(np.uint8))  # separators dropped


def test_prepare_leaves_nothing_in_the_temp_directory(tmp_path, monkeypatch):
    """TFDS's DatasetInfo makes a temporary directory it never removes when it looks for a
    dataset's published statistics; a written dataset has none to look for."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    assert _prepare(tmp_path, "--tokenizer=byte", text=CORPUS[:2000]) == 0
    assert list(scratch.iterdir()) == []


def test_bpe_trained_by_prepare(tmp_path):
    assert _prepare(tmp_path, "--tokenizer=bpe", "--train_bpe=300") == 0
    source = make_source(_cfg(data_dir=str(tmp_path / "d")), vocab_size=-1, seq_len=SEQ, seed=0)
    assert source.vocab_size == 300 and source.info["tokenizer"] == "bpe"
    batch = next(source.train_batches(4))
    assert batch.max() < 300 and "quick brown" in source.tokenizer.decode(batch.ravel())


@pytest.mark.slow
def test_worker_processes_give_the_same_batches_and_state(char_dataset):
    source = make_source(_cfg(data_dir=str(char_dataset / "d")), vocab_size=-1, seq_len=SEQ, seed=0)
    want = _take(source.train_batches(8), 12)
    it = source.train_batches(8, workers=2, prefetch=2)
    got = _take(it, 6)
    state = it.get_state()
    resumed = source.train_batches(8, workers=1)
    resumed.set_state(state)
    got += _take(resumed, 6)
    for a, b in zip(want, got):
        np.testing.assert_array_equal(a, b)
    assert state["position"] == 6 * 8


def _text_dataset(data_dir: Path):
    """A TFDS dataset of the catalog kind: records are documents with a text feature."""
    class Sentences(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        VERSION = tfds.core.Version("1.0.0")
        code_path = None

        def _info(self):
            return tfds.core.DatasetInfo(builder=self, disable_shuffling=True,
                                         features=tfds.features.FeaturesDict({"text": tfds.features.Text()}))

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples(0, 300), "test": self._generate_examples(300, 340)}

        def _generate_examples(self, lo, hi):
            for i in range(lo, hi):
                yield i, {"text": f"sentence number {i} ✓"}

    Sentences.name = "sentences"
    Sentences(data_dir=str(data_dir), file_format="array_record").download_and_prepare()


def test_other_tfds_dataset_is_tokenized_once(tmp_path, monkeypatch):
    _text_dataset(tmp_path)
    cfg = _cfg(name="sentences", data_dir=str(tmp_path), eval_split="test", feature="text")
    source = make_source(cfg, vocab_size=-1, seq_len=SEQ, seed=0)
    docs = [f"sentence number {i} ✓".encode() for i in range(300, 340)]
    val = np.concatenate([np.append(np.frombuffer(d, np.uint8), 256) for d in docs])
    ev = np.concatenate(list(source.eval_batches(1, 5)))
    for i, row in enumerate(ev):
        np.testing.assert_array_equal(row, val[i * SEQ: i * SEQ + SEQ + 1])
    assert source.info["name"] == "sentences__text_train_test_byte"
    calls = []
    monkeypatch.setattr(catalog, "convert", lambda *a: calls.append(a))
    again = make_source(cfg, vocab_size=-1, seq_len=SEQ, seed=0)  # reads the cache
    assert calls == [] and again.fingerprint() == source.fingerprint()
    with pytest.raises(UserError, match=r"no feature 'body'.*\['text'\]"):
        make_source(_cfg(name="sentences", data_dir=str(tmp_path), eval_split="test",
                         feature="body"), vocab_size=-1, seq_len=SEQ, seed=0)
    with pytest.raises(UserError, match=r"no split 'validation'.*\['train', 'test'\]|'test', 'train'"):
        make_source(_cfg(name="sentences", data_dir=str(tmp_path), feature="text"),
                    vocab_size=-1, seq_len=SEQ, seed=0)


@pytest.mark.slow
def test_two_processes_read_disjoint_shards_of_the_global_batch(tmp_path):
    assert _prepare(tmp_path, "--tokenizer=byte") == 0
    out = tmp_path / "out"
    out.mkdir()
    port = str(free_port())
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "data_worker.py"), str(p), "2",
                               port, str(tmp_path / "d"), str(out)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for p in range(2)]
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)[-3000:]
    single = make_source(_cfg(data_dir=str(tmp_path / "d")), vocab_size=-1, seq_len=SEQ, seed=0)
    for b, want in enumerate(_take(single.train_batches(8), 3)):
        parts = [np.load(out / f"local_p{p}_b{b}.npy") for p in range(2)]
        assert all(part.shape == (4, SEQ + 1) for part in parts)
        np.testing.assert_array_equal(np.concatenate(parts), want)  # the union, in order
        rows = {r.tobytes() for r in parts[0]} & {r.tobytes() for r in parts[1]}
        assert not rows  # no window read twice
        for p in range(2):  # the global array every process sees is the global batch
            np.testing.assert_array_equal(np.load(out / f"global_p{p}_b{b}.npy"), want)


@pytest.mark.slow
def test_two_processes_convert_a_catalog_dataset_as_one_does(tmp_path):
    """Each of 2 processes tokenizes its share of the records with 2 workers; the dataset
    is byte for byte the one a single process writes (meshtrain/data/catalog.py)."""
    _text_dataset(tmp_path)
    make_source(_cfg(name="sentences", data_dir=str(tmp_path), eval_split="test", feature="text",
                     cache_dir=str(tmp_path / "one")), vocab_size=-1, seq_len=SEQ, seed=0)
    out = tmp_path / "two"
    out.mkdir()
    port = str(free_port())
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "data_worker.py"), str(p), "2", port,
                               str(tmp_path), str(out), "catalog"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for p in range(2)]
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)[-3000:]
    assert "process 1 of 2" in logs[1], logs[1][-2000:]
    files = lambda root: {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}  # noqa: E731
    one, two = files(tmp_path / "one"), files(out)
    assert sorted(one) == sorted(two) and any(str(f).endswith("array_record-00000-of-00001") for f in one)
    assert all(one[f] == two[f] for f in one), [str(f) for f in one if one[f] != two[f]]


# --- errors ------------------------------------------------------------------------

def _error(capsys, *args, tmp=None, **kw) -> str:
    code = _prepare(tmp, *args, **kw) if tmp else prepare(list(args))
    assert code == 2
    return capsys.readouterr().err


def test_prepare_errors(tmp_path, capsys, monkeypatch):
    assert "matches no file" in _error(capsys, "--input=/no/such/*.txt", "--name=x",
                                       f"--data_dir={tmp_path}")
    assert "holds no text" in _error(capsys, tmp=tmp_path, text="")
    assert "not a valid TFDS name" in _error(capsys, tmp=tmp_path, name="My-Data")
    assert "--train_bpe=2048" in _error(capsys, "--tokenizer=bpe", tmp=tmp_path)
    assert "--workers=0: must be >= 1" in _error(capsys, "--workers=0", tmp=tmp_path)
    assert "does not exist" in _error(capsys, "--tokenizer=bpe:/no/tokenizer.json", tmp=tmp_path)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty"))
    assert "gpt2:DIR" in _error(capsys, "--tokenizer=gpt2", tmp=tmp_path)
    assert _prepare(tmp_path) == 0
    assert "already exists" in _error(capsys, tmp=tmp_path)
    assert _prepare(tmp_path, "--overwrite") == 0


def test_tfds_source_errors(tmp_path, char_dataset):
    with pytest.raises(UserError, match="data.name is not set"):
        make_source(_cfg(name=""), vocab_size=-1, seq_len=SEQ, seed=0)
    with pytest.raises(UserError, match=r"'nosuch' was not found.*Datasets there: corpus"):
        make_source(_cfg(name="nosuch", data_dir=str(char_dataset / "d")), vocab_size=-1,
                    seq_len=SEQ, seed=0)
    with pytest.raises(UserError, match=r"no split 'dev'.*'train', 'validation'"):
        make_source(_cfg(data_dir=str(char_dataset / "d"), eval_split="dev"), vocab_size=-1,
                    seq_len=SEQ, seed=0)
    with pytest.raises(UserError, match=r"training split.*seq_len \+ 1 = 100001"):
        make_source(_cfg(data_dir=str(char_dataset / "d")), vocab_size=-1, seq_len=100_000, seed=0)


def test_damaged_dataset_is_refused(tmp_path):
    assert _prepare(tmp_path, "--record_tokens=100") == 0
    meta_path = tmp_path / "d" / "corpus" / "1.0.0" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    meta["num_tokens"]["train"] -= 1
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(UserError, match="damaged.*prepare --overwrite"):
        make_source(_cfg(data_dir=str(tmp_path / "d")), vocab_size=-1, seq_len=SEQ, seed=0)
    (tmp_path / "d" / "corpus" / "1.0.0" / "tokenizer.json").write_text("{not json")
    with pytest.raises(UserError, match="Could not read the tokenizer file"):
        make_source(_cfg(data_dir=str(tmp_path / "d")), vocab_size=-1, seq_len=SEQ, seed=0)
