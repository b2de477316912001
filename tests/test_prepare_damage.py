"""Damaged inputs: a corpus in each format prepare reads, cut, flipped, zeroed, emptied or
missing a sibling file (tests/support/damaged_corpora.py), prepares to its undamaged
dataset byte for byte or is refused with status 2 and one line naming the file; never
status 0 with another dataset, never a traceback. Damage no format can tell (a plain
file cut at a line break, a flip inside unchecked ids) is not made: damaged_corpora's
NOT_CHECKED lists it, and docs/data.md ("Damaged inputs") says so."""

import base64
import collections
import functools
import json
import shutil

import numpy as np
import pytest

from meshtrain.data import prepare as prepare_module
from meshtrain.data.hf_tokenizer import special_id
from meshtrain.data.tokenizers import make_tokenizer
from support import damaged_corpora

WORDS = "the cat sat on a mat and ate its hat while a dog ran past".split()


@pytest.fixture(scope="module")
def documents():
    rng = np.random.default_rng(0)
    return [" ".join(rng.choice(WORDS, rng.integers(3, 30))) for _ in range(200)]


@pytest.fixture(scope="module")
def wide_vocabulary(tmp_path_factory):
    """hf:DIR of a tiktoken tokenizer of 65,536 ids (256 bytes, 65,024 pairs, 256 special):
    every uint16 is one of its ids, so ids misread from a damaged token file pass the
    vocabulary check and only the format's own checks can refuse them."""
    d = tmp_path_factory.mktemp("wide")
    ranks = [bytes([b]) for b in range(256)] + [bytes([a, b]) for a in range(1, 255) for b in range(256)][:65024]
    (d / "tokenizer.model").write_text("".join(f"{base64.b64encode(r).decode()} {i}\n" for i, r in enumerate(ranks)))
    return f"hf:{d}"


def _dataset(data_dir, name: str) -> tuple:
    """What a prepared dataset holds: its shards' bytes in order, and its counts."""
    root = data_dir / name / "1.0.0"
    meta = json.loads((root / "metadata.json").read_text())
    return (tuple(p.read_bytes() for p in sorted(root.glob("*.array_record-*"))),
            meta["num_tokens"], meta["num_documents"])


def test_every_format_damaged_every_way_reads_whole_or_is_refused_in_one_line(
        tmp_path, documents, wide_vocabulary, monkeypatch, capsys):
    loaded = functools.lru_cache(maxsize=None)(prepare_module.make_tokenizer)  # one load a spec, not one a case
    monkeypatch.setattr(prepare_module, "make_tokenizer", loaded)
    byte, wide = make_tokenizer("byte"), loaded(wide_vocabulary)
    rng = np.random.default_rng(53)
    table, bad = collections.defaultdict(collections.Counter), []
    for fmt in damaged_corpora.FORMATS:
        tokens = fmt.startswith(("llmc", "nanogpt", "megatron"))
        spec = wide_vocabulary if tokens else "byte"
        tok = wide if tokens else byte
        ids = [np.array([(int(i) + 300 * k) % 65000 for i in tok.encode(d)]) if tokens else None
               for k, d in enumerate(documents)]
        clean = tmp_path / fmt / "clean"
        source, ends = damaged_corpora.write(fmt, clean, documents, ids if tokens else [], tok.eot_id,
                                             special_id(tok, "<|begin_of_text|>"))

        def prepare(folder, name):
            args = [f"--input={folder / source.relative_to(clean)}", f"--name={name}",
                    f"--data_dir={tmp_path / fmt / 'd'}", f"--tokenizer={spec}", "--val_fraction=0.1",
                    "--record_tokens=512", "--overwrite"]
            try:
                rc, escaped = prepare_module.main(args), ""
            except Exception as e:  # noqa: BLE001 - what the command line would show as a traceback
                rc, escaped = None, f"Traceback: {type(e).__name__}: {e}"
            return rc, capsys.readouterr().err + escaped

        assert prepare(clean, "clean")[0] == 0, fmt
        want = _dataset(tmp_path / fmt / "d", "clean")
        for kind, label, damage in damaged_corpora.damages(fmt, clean, ends, rng):
            copy = tmp_path / fmt / "copy"
            for old in (copy, tmp_path / fmt / "d" / "damaged", tmp_path / fmt / "d" / ".damaged.prepare"):
                shutil.rmtree(old, ignore_errors=True)  # each case alone: nothing resumed from the last
            shutil.copytree(clean, copy)
            damage(copy)
            rc, text = prepare(copy, "damaged")
            err = text.strip().splitlines()
            if "Traceback" in text or rc not in (0, 2):
                outcome = "traceback"
            elif rc == 0:
                outcome = "same" if _dataset(tmp_path / fmt / "d", "damaged") == want else "DIFFERENT"
            else:  # the error is the last line, one line, naming a file of the copy
                said = [k for k, line in enumerate(err) if line.startswith("meshtrain prepare: error: ")]
                one = said == [len(err) - 1] and str(copy) in err[-1]
                outcome = "refused" if one else "refused, not in one line naming the file"
            table[(fmt, kind)][outcome] += 1
            if outcome not in ("same", "refused"):
                bad.append(f"{fmt} {label}: {outcome}: {text[-600:]}")
    print("\nformat       damage    cases  same  refused  other")
    for (fmt, kind), seen in table.items():
        other = ", ".join(f"{n} {k}" for k, n in seen.items() if k not in ("same", "refused"))
        print(f"{fmt:<12} {kind:<9} {sum(seen.values()):>5} {seen['same']:>5} {seen['refused']:>8}  {other}")
    print(f"not made (no format can tell): {damaged_corpora.NOT_CHECKED}")
    assert not bad, "\n".join(bad)


def test_a_zst_file_cut_at_a_line_break_among_others_is_refused_by_the_workers_that_read_it(
        tmp_path, documents, capsys):
    """The issue's silent case, on the path large corpora take: two workers, several files,
    one .jsonl.zst cut where a block (and a line) ends."""
    folder = tmp_path / "corpus"
    for k in range(3):
        _, ends = damaged_corpora.write("jsonl.zst", folder / str(k), documents, [], 0)
        (folder / str(k) / "c.jsonl.zst").rename(folder / f"part{k}.jsonl.zst")
    cut = folder / "part1.jsonl.zst"
    with open(cut, "r+b") as f:
        f.truncate(ends["c.jsonl.zst"][1])  # the second block's end: 80 whole lines
    assert prepare_module.main([f"--input={folder}/*.jsonl.zst", "--name=x", f"--data_dir={tmp_path / 'd'}",
                                "--workers=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"meshtrain prepare: error: '{cut}' is truncated: it ends at byte "), err[-1]
    assert "Traceback" not in "\n".join(err)


def test_a_zst_file_of_several_frames_prepares_like_one_frame(tmp_path, documents):
    """Frames one after another (pzstd's output, files joined with cat) and a skippable frame
    among them read as the whole: a frame's end is not the file's."""
    import zstandard
    text = "".join(f'{{"text": "{d}"}}\n' for d in documents).encode()
    c = zstandard.ZstdCompressor(write_checksum=True)
    skippable = (0x184D2A50).to_bytes(4, "little") + (3).to_bytes(4, "little") + b"abc"
    (tmp_path / "one.jsonl.zst").write_bytes(c.compress(text))
    (tmp_path / "many.jsonl.zst").write_bytes(c.compress(text[:3000]) + skippable + c.compress(text[3000:7000])
                                             + c.compress(text[7000:]))
    for name in ("one", "many"):
        assert prepare_module.main([f"--input={tmp_path / name}.jsonl.zst", f"--name={name}",
                                    f"--data_dir={tmp_path / 'd'}"]) == 0
    assert _dataset(tmp_path / "d", "many") == _dataset(tmp_path / "d", "one")
