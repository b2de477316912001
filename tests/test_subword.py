"""Subword tokenizers: BPE training, tokenizer.json round trips, GPT-2 from local files.

Nothing here uses the network. GPT-2's real files are 1.5 MB and not in the repository,
so the gpt2:DIR tests fabricate a tiny vocabulary in GPT-2's data-gym format: the 256
byte tokens (named by GPT-2's bytes_to_unicode mapping, in tiktoken's rank order) plus
a few merges and "<|endoftext|>". tiktoken's loader accepts it as it would the real files.
"""

import hashlib
import json

import numpy as np
import pytest
import tokenizers

from meshtrain.data import subword
from meshtrain.data.subword import BPETokenizer, GPT2Tokenizer, train_bpe
from meshtrain.errors import UserError
from support.tokenizer_files import CORPUS, EOT, MERGES, SAMPLES, fake_gpt2_dir


@pytest.fixture(scope="module")
def bpe():
    return train_bpe(iter(CORPUS), vocab_size=400)


def test_train_bpe_vocab_and_eot(bpe):
    assert bpe.name == "bpe"
    assert bpe.vocab_size == 400
    assert bpe.hf.get_vocab_size(with_added_tokens=True) == 400
    assert bpe.hf.id_to_token(bpe.eot_id) == EOT
    assert bpe.describe() == "bpe (trained, 400 ids)"


def test_bpe_round_trip_and_batch(bpe):
    for text in SAMPLES:
        ids = bpe.encode(text)
        assert ids.dtype == np.int32 and ids.ndim == 1
        assert ((ids >= 0) & (ids < bpe.vocab_size)).all()
        assert bpe.decode(ids) == text
    assert len(bpe.encode("The quick brown fox")) < len("The quick brown fox")  # merges used
    batch = bpe.encode_batch(SAMPLES)
    assert len(batch) == len(SAMPLES)
    for text, ids in zip(SAMPLES, batch):
        assert ids.dtype == np.int32
        np.testing.assert_array_equal(ids, bpe.encode(text))


def test_bpe_literal_eot_is_ordinary_text(bpe):
    # encode_special_tokens=True: the literal is split into byte-level pieces.
    for ids in (bpe.encode("a" + EOT + "b"), bpe.encode_batch(["a" + EOT + "b"])[0]):
        assert bpe.eot_id not in ids.tolist()
        assert bpe.decode(ids) == "a" + EOT + "b"
    # decode keeps a real end of text visible.
    assert bpe.decode([bpe.eot_id]) == EOT


def test_bpe_save_round_trip(bpe, tmp_path):
    path = tmp_path / "tokenizer.json"
    bpe.save(path)
    again = BPETokenizer.from_file(path)
    hf = tokenizers.Tokenizer.from_file(str(path))
    assert (again.vocab_size, again.eot_id) == (bpe.vocab_size, bpe.eot_id)
    assert again.describe() == "bpe (tokenizer.json, 400 ids)"
    assert hf.token_to_id(EOT) == bpe.eot_id
    for text in SAMPLES:
        np.testing.assert_array_equal(again.encode(text), bpe.encode(text))
        if EOT not in text:  # plain HF matches the literal as the special token
            assert hf.encode(text, add_special_tokens=False).ids == bpe.encode(text).tolist()
    assert bpe.to_json() == json.loads(path.read_text())
    assert bpe.to_json()["added_tokens"][0]["content"] == EOT


def _wordlevel_json(tmp_path):
    hf = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    hf.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    path = tmp_path / "wordlevel.json"
    hf.save(str(path))
    return path


def test_from_file_adds_eot(tmp_path):
    path = _wordlevel_json(tmp_path)
    tok = BPETokenizer.from_file(path)
    assert (tok.vocab_size, tok.eot_id) == (4, 3)
    assert tok.encode("hello world nope").tolist() == [1, 2, 0]
    # Saved with the added token, which both readers then see at the same id.
    tok.save(tmp_path / "with_eot.json")
    assert tokenizers.Tokenizer.from_file(str(tmp_path / "with_eot.json")).token_to_id(EOT) == 3
    assert BPETokenizer.from_file(tmp_path / "with_eot.json").vocab_size == 4


def test_from_file_errors(tmp_path):
    with pytest.raises(UserError, match=r"nope\.json.*does not exist"):
        BPETokenizer.from_file(tmp_path / "nope.json")
    with pytest.raises(UserError, match="is a directory"):
        BPETokenizer.from_file(tmp_path)
    _wordlevel_json(tmp_path).rename(tmp_path / "tokenizer.json")
    with pytest.raises(UserError, match="is a directory.*It has a tokenizer.json"):
        BPETokenizer.from_file(tmp_path)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(UserError, match=r"bad\.json.*not valid JSON"):
        BPETokenizer.from_file(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text('{"kind": "byte"}')
    with pytest.raises(UserError, match=r"other\.json.*not a Hugging Face tokenizer"):
        BPETokenizer.from_file(tmp_path / "other.json")


def test_train_bpe_errors():
    with pytest.raises(UserError, match="at least 257 ids.*vocab_size is 256"):
        train_bpe(CORPUS, vocab_size=256)
    with pytest.raises(UserError, match="corpus only supports"):
        train_bpe(["tiny tiny"], vocab_size=5000)


# --- GPT-2 -----------------------------------------------------------------------------


def test_gpt2_from_dir(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    d, encoder = fake_gpt2_dir(tmp_path)
    tok = GPT2Tokenizer.load(str(d))
    assert (tok.name, tok.vocab_size, tok.eot_id) == ("gpt2", 256 + len(MERGES) + 1, 261)
    ids = tok.encode("hello world")
    assert ids.dtype == np.int32
    # hello -> [hell, o]; " world" -> [" wo", r, l, d]: the merges are applied.
    assert ids.tolist() == [encoder["hell"], encoder["o"], encoder["Ġwo"], encoder["r"],
                            encoder["l"], encoder["d"]]
    for text in SAMPLES:
        assert tok.decode(tok.encode(text)) == text
    assert tok.eot_id not in tok.encode(EOT).tolist()  # a literal is ordinary text
    assert tok.decode([tok.eot_id]) == EOT
    for text, batch_ids in zip(SAMPLES, tok.encode_batch(SAMPLES)):
        np.testing.assert_array_equal(batch_ids, tok.encode(text))
    assert list(cache.iterdir()) == []  # local files are not copied into tiktoken's cache
    assert tok.describe() == f"gpt2 ({d}, 262 ids)"
    tok.save(tmp_path / "tok.json")
    assert json.loads((tmp_path / "tok.json").read_text()) == {"kind": "gpt2", "dir": str(d)}


def test_gpt2_dir_errors(tmp_path):
    with pytest.raises(UserError, match="lacks vocab.bpe and encoder.json"):
        GPT2Tokenizer.load(str(tmp_path))
    with pytest.raises(UserError, match="nope' does not exist"):
        GPT2Tokenizer.load(str(tmp_path / "nope"))
    d, encoder = fake_gpt2_dir(tmp_path)
    encoder["xyz"] = encoder.pop("Ġwo")  # no longer matches the merges
    (d / "encoder.json").write_text(json.dumps(encoder))
    with pytest.raises(UserError, match="does not match the merges"):
        GPT2Tokenizer.load(str(d))


def test_gpt2_cache_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    with pytest.raises(UserError) as info:
        GPT2Tokenizer.load()
    message = str(info.value)
    assert "vocab.bpe is missing" in message and "gpt2:DIR" in message
    for name in ("vocab.bpe", "encoder.json"):
        assert subword._GPT2_URL + name in message and subword._cache_name(name) in message
    # The names tiktoken's read_file_cached uses: sha1 of the URL.
    url = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe"
    assert subword._cache_name("vocab.bpe") == hashlib.sha1(url.encode()).hexdigest()


def test_gpt2_cache_damaged_is_not_redownloaded(tmp_path, monkeypatch):
    # Files with the right names but the wrong contents: tiktoken would delete and
    # download them again, so load() must stop first.
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    for name in ("vocab.bpe", "encoder.json"):
        (tmp_path / subword._cache_name(name)).write_text("junk")
    with pytest.raises(UserError, match="wrong sha256"):
        GPT2Tokenizer.load()
    assert len(list(tmp_path.iterdir())) == 2
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")
    with pytest.raises(UserError, match="caching is off"):
        GPT2Tokenizer.load()
