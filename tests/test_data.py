"""Data sources: the synthetic Markov chain, local text, and the batch contract."""

import json

import ml_collections
import numpy as np
import pytest

from meshtrain.data import load_tokenizer, make_source
from meshtrain.data.synthetic import MarkovChain
from meshtrain.data.windows import num_windows
from meshtrain.data.tokenizers import ByteTokenizer, CharTokenizer
from meshtrain.errors import UserError

SEQ = 16


def _cfg(**kw):
    base = dict(kind="synthetic", path="", tokenizer="byte", name="", data_dir="",
                split="train", val_fraction=0.1)
    base.update(kw)
    return ml_collections.ConfigDict(base)


def _synthetic(vocab=64, seq_len=SEQ, seed=0):
    return make_source(_cfg(), vocab_size=vocab, seq_len=seq_len, seed=seed)


def _take(it, n):
    return [next(it) for _ in range(n)]


# --- synthetic -----------------------------------------------------------------

@pytest.mark.parametrize("vocab", [2, 3, 8, 9, 64, 300, 2000])
def test_pi_is_stationary(vocab):
    chain = MarkovChain(vocab, seed=1)
    assert np.all(chain.pi >= 0) and abs(chain.pi.sum() - 1) < 1e-12
    np.testing.assert_allclose(chain.pi @ chain.dense(), chain.pi, rtol=0, atol=1e-9)


def test_successor_table_shape():
    chain = MarkovChain(300, seed=0)
    v = np.arange(300)
    assert chain.succ.shape == (300, 8) and chain.succ.dtype == np.int32
    assert np.all(chain.succ[:, 0] == (v + 1) % 300)  # irreducible by construction
    assert all(len(set(row)) == 8 for row in chain.succ)
    np.testing.assert_allclose(chain.cum[:, -1], 1.0)
    small = MarkovChain(3, seed=0)
    assert sorted(small.succ[0]) == [0, 1, 2]


def test_entropy_rate_matches_monte_carlo():
    source = _synthetic(vocab=64, seq_len=128, seed=3)
    chain = MarkovChain(64, seed=3)
    windows = np.concatenate(_take(source.train_batches(64), 8))  # [512, 129]
    per_window = -chain.log_prob(windows).mean(axis=1)
    # Windows start independently from pi, so their mean losses are i.i.d.
    mean, se = per_window.mean(), per_window.std(ddof=1) / np.sqrt(len(per_window))
    h = source.info["entropy_rate"]
    assert abs(mean - h) < 4 * se, (mean, h, se)
    assert source.info["best_loss"] == h < source.info["unigram_entropy"]


def test_first_token_follows_pi():
    chain = MarkovChain(8, seed=0)
    first = _synthetic(vocab=8, seed=0).train_batches(4096)
    counts = np.bincount(next(first)[:, 0], minlength=8) / 4096
    assert np.abs(counts - chain.pi).max() < 0.04


def test_synthetic_batches_are_deterministic_and_batch_size_free():
    a = _take(_synthetic().train_batches(8), 3)
    b = _take(_synthetic().train_batches(8), 3)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert a[0].shape == (8, SEQ + 1) and a[0].dtype == np.int32
    small = _take(_synthetic().train_batches(4), 6)
    # Batch 2 at size 8 is windows 16..23: batches 4 and 5 at size 4.
    np.testing.assert_array_equal(a[2], np.concatenate(small[4:6]))
    assert not np.array_equal(_take(_synthetic(seed=1).train_batches(8), 1)[0], a[0])


def test_process_split_concatenates_to_global_batch():
    source = _synthetic()
    full = _take(source.train_batches(8), 3)
    parts = [_take(source.train_batches(8, process_index=p, process_count=2), 3)
             for p in range(2)]
    for b in range(3):
        assert parts[0][b].shape == (4, SEQ + 1)
        np.testing.assert_array_equal(np.concatenate([parts[0][b], parts[1][b]]), full[b])


def test_start_step_skips_ahead():
    source = _synthetic()
    it = source.train_batches(8)
    advanced = _take(it, 6)[5]
    np.testing.assert_array_equal(next(source.train_batches(8, start_step=5)), advanced)


def test_eval_is_held_out_and_repeatable():
    source = _synthetic()
    train = np.concatenate(_take(source.train_batches(8), 4))
    ev = list(source.eval_batches(8, 4))
    assert len(ev) == 4
    ev = np.concatenate(ev)
    train_rows = {r.tobytes() for r in train}
    assert not any(r.tobytes() in train_rows for r in ev)
    np.testing.assert_array_equal(np.concatenate(list(source.eval_batches(8, 4))), ev)


def test_batch_not_divisible_by_processes():
    with pytest.raises(UserError, match="batch_size=6 with 4 processes"):
        _synthetic().train_batches(6, process_count=4)
    with pytest.raises(UserError, match="batch_size=3 with 2 processes"):
        _synthetic().eval_batches(3, 1, process_count=2)


def test_gpt2_sized_vocab_draws_within_it():
    # (How fast a batch comes is benchmarks/data.py's to measure: a timed assertion here
    # failed whenever the suite's other worker was busy.)
    source = _synthetic(vocab=50257, seq_len=64)
    batch = next(source.train_batches(8))
    assert source.vocab_size == 50257 and batch.max() < 50257
    assert 0 < source.info["entropy_rate"] < np.log(8)


def test_info_is_json():
    json.dumps(_synthetic().info)


def test_default_synthetic_vocab():
    assert _synthetic(vocab=-1).vocab_size == 256
    with pytest.raises(UserError, match="vocab_size is 1"):
        _synthetic(vocab=1)


# --- tokenizers ----------------------------------------------------------------

TEXT = "Hello, wörld! Ünïcode ✓ 日本語\nline two\n"


def test_byte_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    assert ids.dtype == np.int32 and len(ids) == len(TEXT.encode("utf-8"))
    assert tok.decode(np.append(ids, tok.eot_id)) == TEXT and tok.vocab_size == 257
    raw = bytes(range(256))  # not UTF-8: survives the corpus's surrogateescape decode
    assert bytes(tok.encode(raw.decode("utf-8", "surrogateescape")).astype(np.uint8)) == raw


def test_char_round_trip_and_reload(tmp_path):
    tok = CharTokenizer.from_text(TEXT)
    ids = tok.encode(TEXT)
    assert ids.dtype == np.int32 and tok.vocab_size == len(set(TEXT)) + 1
    assert tok.eot_id == len(set(TEXT)) and tok.decode(np.append(ids, tok.eot_id)) == TEXT
    assert list(tok.chars) == sorted(set(TEXT))
    tok.save(tmp_path / "vocab.json")
    again = load_tokenizer(tmp_path / "vocab.json")
    np.testing.assert_array_equal(again.encode(TEXT), ids)
    with pytest.raises(UserError, match="'Z'"):
        tok.encode("Z")


# --- text source ---------------------------------------------------------------

def _write(tmp_path, text, name="corpus.txt"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def _text(path, tokenizer="byte", val_fraction=0.25, seq_len=SEQ, seed=0):
    cfg = _cfg(kind="text", path=str(path), tokenizer=tokenizer, val_fraction=val_fraction)
    return make_source(cfg, vocab_size=50257, seq_len=seq_len, seed=seed)


CORPUS = "".join(f"line {i}: the quick brown fox — {i * i}\n" for i in range(60))


def _streams(text: str, val_fraction=0.25):
    """The expected byte-token streams: the cut falls on a line break near the fraction."""
    data = text.encode("utf-8")
    want = len(data) - round(len(data) * val_fraction)
    cut = data.rfind(b"\n", 0, want) + 1
    eot = np.array([256], np.int32)
    as_ids = lambda b: np.frombuffer(b, np.uint8).astype(np.int32)  # noqa: E731
    return np.concatenate([as_ids(data[:cut]), eot]), np.concatenate([as_ids(data[cut:]), eot])


def test_text_split_and_windows(tmp_path):
    source = _text(_write(tmp_path, CORPUS))
    train, val = _streams(CORPUS)
    info = source.info
    assert source.vocab_size == 257 and info["tokenizer"] == "byte" and info["eot_id"] == 256
    assert (info["train_tokens"], info["val_tokens"]) == (len(train), len(val))
    assert abs(len(val) - 0.25 * len(CORPUS.encode())) < 50  # within a line of the fraction
    n_train = num_windows(len(train), SEQ)
    assert info["train_windows"] == n_train == (len(train) - 1) // SEQ
    # One epoch of train windows: every window once, each an exact stride-SEQ slice.
    epoch = np.concatenate(_take(source.train_batches(1), n_train))
    slices = {train[i * SEQ: i * SEQ + SEQ + 1].tobytes() for i in range(n_train)}
    assert {row.tobytes() for row in epoch} == slices and len(epoch) == n_train
    assert epoch.dtype == np.int32
    # Eval: the held-out tail, in order.
    ev = next(source.eval_batches(4, 1))
    for i, row in enumerate(ev):
        np.testing.assert_array_equal(row, val[i * SEQ: i * SEQ + SEQ + 1])


def test_documents_are_joined_with_end_of_text(tmp_path):
    files = {"a.txt": "first document\n" * 5, "b.txt": "second one\n" * 5, "c.txt": "third\n" * 40}
    for name, text in files.items():
        _write(tmp_path, text, name)
    source = _text(tmp_path / "*.txt", val_fraction=0.5, seq_len=4)
    total = sum(len(t) for t in files.values())
    assert total - round(total * 0.5) == 130 + 55  # the cut falls in c.txt, on line 10 ...
    c_train = "third\n" * 9  # ... so it moves back to the line break before it
    as_ids = lambda t: list(t.encode())  # noqa: E731
    train = as_ids(files["a.txt"]) + [256] + as_ids(files["b.txt"]) + [256] + as_ids(c_train) + [256]
    assert source.info["train_tokens"] == len(train)
    rows = np.concatenate(_take(source.train_batches(1), source.info["train_windows"]))
    train = np.array(train)
    assert {r.tobytes() for r in rows} == {train[i * 4: i * 4 + 5].astype(np.int32).tobytes()
                                          for i in range(len(rows))}


def test_random_offset_windows(tmp_path):
    path = _write(tmp_path, CORPUS)
    source = _text(path, seed=3)
    cfg = _cfg(kind="text", path=str(path), val_fraction=0.25, random_offsets=True)
    rand = make_source(cfg, vocab_size=-1, seq_len=SEQ, seed=3)
    train, _ = _streams(CORPUS)
    rows = np.concatenate(_take(rand.train_batches(8), 50))
    starts = set()
    for row in rows:  # every row is a contiguous slice of the train stream
        hits = [i for i in range(len(train) - SEQ) if np.array_equal(train[i: i + SEQ + 1], row)]
        assert hits
        starts.add(hits[0])
    assert len({s % SEQ for s in starts}) > SEQ // 2  # not on the stride grid
    again = np.concatenate(_take(make_source(cfg, vocab_size=-1, seq_len=SEQ, seed=3)
                                 .train_batches(8), 50))
    np.testing.assert_array_equal(rows, again)
    assert rand.fingerprint() != source.fingerprint()
    assert rand.info["random_offsets"] and rand.info["window_stride"] is None


def test_text_shuffle_is_seeded_and_reshuffled(tmp_path):
    path = _write(tmp_path, CORPUS)
    a = np.concatenate(_take(_text(path).train_batches(4), 10))
    b = np.concatenate(_take(_text(path).train_batches(4), 10))
    c = np.concatenate(_take(_text(path, seed=1).train_batches(4), 10))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    n = _text(path).info["train_windows"]
    first, second = (np.concatenate(_take(_text(path).train_batches(1, start_step=s), n))
                     for s in (0, n))
    assert not np.array_equal(first, second)  # each epoch is reshuffled
    assert {r.tobytes() for r in first} == {r.tobytes() for r in second}  # same windows


def test_text_process_split_and_resume(tmp_path):
    source = _text(_write(tmp_path, CORPUS))
    full = _take(source.train_batches(4), 3)
    parts = [_take(source.train_batches(4, process_index=p, process_count=2), 3)
             for p in range(2)]
    for b in range(3):
        np.testing.assert_array_equal(np.concatenate([parts[0][b], parts[1][b]]), full[b])
    np.testing.assert_array_equal(next(source.train_batches(4, start_step=2)), full[2])


@pytest.mark.parametrize("prefetch", [0, 2])
def test_iterator_state_restores_the_stream(tmp_path, prefetch):
    source = _text(_write(tmp_path, CORPUS))
    epoch = source.info["train_windows"] // 4 + 1  # run across an epoch boundary
    it = source.train_batches(4, prefetch=prefetch)
    _take(it, epoch - 1)
    state = json.loads(json.dumps(it.get_state()))  # it survives JSON
    unbroken = _take(it, 4)
    resumed = source.train_batches(4, prefetch=prefetch)
    resumed.set_state(state)
    for a, b in zip(unbroken, _take(resumed, 4)):
        np.testing.assert_array_equal(a, b)
    assert state == {"position": 4 * (epoch - 1), "stream": source.fingerprint()}
    # A state from another stream is refused with the reason.
    other = _text(_write(tmp_path, CORPUS), seed=1).train_batches(4)
    with pytest.raises(UserError, match="another window stream"):
        other.set_state(state)


def test_state_restores_under_another_batch_size(tmp_path):
    source = _text(_write(tmp_path, CORPUS))
    it = source.train_batches(4)
    _take(it, 3)
    rest = np.concatenate(_take(it, 2))
    resized = source.train_batches(8)
    resized.set_state(it.get_state() | {"position": 12})
    np.testing.assert_array_equal(next(resized), rest)


def test_text_eval_cycles(tmp_path):
    source = _text(_write(tmp_path, CORPUS))
    n_val = source.info["val_windows"]
    rows = np.concatenate(list(source.eval_batches(1, 2 * n_val)))
    np.testing.assert_array_equal(rows[:n_val], rows[n_val:])


def test_char_text_source_and_glob(tmp_path):
    _write(tmp_path, CORPUS[:900], "b.txt")
    _write(tmp_path, CORPUS[900:], "a.txt")
    source = _text(tmp_path / "*.txt", tokenizer="char")
    assert source.info["files"] == [str(tmp_path / "a.txt"), str(tmp_path / "b.txt")]
    assert source.vocab_size == len(set(CORPUS)) + 1 == source.tokenizer.eot_id + 1
    # The held-out tail is the end of b.txt, then end of text.
    row = next(source.eval_batches(1, 1))[0]
    n_val = source.info["val_tokens"]
    tail = CORPUS[:900][len(CORPUS[:900]) - (n_val - 1):]
    assert source.tokenizer.decode(row) == (tail)[: SEQ + 1]


# --- user errors ---------------------------------------------------------------

def test_missing_path(tmp_path):
    with pytest.raises(UserError, match="no-such-file.txt"):
        _text(tmp_path / "no-such-file.txt")
    with pytest.raises(UserError, match=r"\*\.md"):
        _text(tmp_path / "*.md")


def test_empty_file(tmp_path):
    path = _write(tmp_path, "")
    with pytest.raises(UserError, match="no text") as e:
        _text(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("bad", [0, 1, 1.5, -0.1, "0.1"])
def test_bad_val_fraction(tmp_path, bad):
    with pytest.raises(UserError, match=f"got {bad!r}".replace(".", r"\.")):
        _text(_write(tmp_path, CORPUS), val_fraction=bad)


def test_too_short(tmp_path):
    path = _write(tmp_path, "x" * 100)  # no line break: the cut is at byte 75
    with pytest.raises(UserError, match=r"training.*76 tokens.*seq_len \+ 1 = 81"):
        _text(path, seq_len=80)
    with pytest.raises(UserError, match=r"held-out.*26 tokens.*seq_len \+ 1 = 30"):
        _text(path, seq_len=29)


def test_unknown_tokenizer(tmp_path):
    with pytest.raises(UserError, match="'wordpiece'.*'byte'.*'char'.*'bpe:PATH'.*'gpt2'"):
        _text(_write(tmp_path, CORPUS), tokenizer="wordpiece")


def test_unknown_kind():
    with pytest.raises(UserError, match="'parquet'.*synthetic, text, tfds"):
        make_source(_cfg(kind="parquet"), vocab_size=-1, seq_len=SEQ, seed=0)
