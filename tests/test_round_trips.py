"""Round trips keep what users need: `convert to_hf` writes a run's tokenizer, of any kind,
as files transformers' AutoTokenizer loads with meshtrain's ids, and token ids inside the
vocabulary; a char-tokenizer run goes to Hugging Face and back (`from_hf`) and samples
the same text as its workdir."""

import json

import numpy as np
import pytest

pytest.importorskip("transformers")

from support import hf_models  # noqa: E402
from support.tokenizer_files import CORPUS, SAMPLES, fake_gpt2_dir  # noqa: E402

from meshtrain import convert, sample  # noqa: E402
from meshtrain.data.tokenizers import make_tokenizer  # noqa: E402
from meshtrain.hf import tokenizer_files  # noqa: E402

TEXTS = [t for t in SAMPLES if t and "<|endoftext|>" not in t] + [CORPUS[3] + CORPUS[5]]


def _tokenizer(kind: str, tmp_path):
    """(meshtrain tokenizer, its spec, texts it encodes) for each kind a run can use."""
    if kind == "char":
        spec, texts = "char", TEXTS
        return make_tokenizer(spec, "".join(texts)), spec, texts
    if kind == "bpe":
        from meshtrain.data.subword import train_bpe
        train_bpe(iter(CORPUS), vocab_size=400).save(tmp_path / "bpe.json")
        spec = f"bpe:{tmp_path / 'bpe.json'}"
    elif kind == "gpt2":
        spec = f"gpt2:{fake_gpt2_dir(tmp_path)[0]}"
    elif kind == "llama3_tiktoken":
        import base64
        ranks = [bytes([b]) for b in range(256)] + [b"th", b"the", b" the", b"ca", b"caf", b"\xc3\xa9"]
        (tmp_path / "tokenizer.model").write_text(
            "".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)))
        spec = f"hf:{tmp_path}"
    elif kind == "hf":
        (tmp_path / "hf").mkdir()
        hf_models.add_tokenizer(tmp_path / "hf", eos="</s>")
        spec = f"hf:{tmp_path / 'hf'}"
    else:
        spec = kind
    return make_tokenizer(spec), spec, TEXTS


@pytest.mark.parametrize("kind", ["byte", "char", "bpe", "gpt2", "llama3_tiktoken", "hf"])
def test_every_tokenizer_exports_as_transformers_loads_it(tmp_path, kind):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer
    tok, spec, texts = _tokenizer(kind, tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    written = tokenizer_files.write_hf_files(tok, spec, out)
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(written)
    hf, theirs = Tokenizer.from_file(str(out / "tokenizer.json")), AutoTokenizer.from_pretrained(out)
    assert theirs.eos_token_id == tok.eot_id and hf.get_vocab_size() <= tok.vocab_size
    for text in texts:
        ids = tok.encode(text).tolist()
        assert hf.encode(text, add_special_tokens=False).ids == ids, text
        assert theirs(text, add_special_tokens=False).input_ids == ids, text
        ids.append(int(tok.eot_id))
        assert hf.decode(ids, skip_special_tokens=False) == theirs.decode(ids) == tok.decode(ids) + (
            "<|endoftext|>" if kind in ("byte", "char") else ""), text  # meshtrain's drop end of text


def _train_char_run(root):
    """gpt2_tiny_dp8 on a small text file, char tokenizer, a few steps."""
    from meshtrain import train
    rng = np.random.default_rng(0)
    words = "the cat sat on a mat and ate its hat while a dog ran past".split()
    for i in range(3):  # three documents, joined by end of text
        (root / f"doc{i}.txt").write_text("\n".join(" ".join(rng.choice(words, 10)) for _ in range(50)) + "\n")
    work = root / "run"
    assert train.run(["--config=gpt2_tiny_dp8", f"--workdir={work}", "--config.data.kind=text",
                      f"--config.data.path={root / 'doc*.txt'}", "--config.data.tokenizer=char",
                      "--config.train.steps=6", "--config.train.eval_every=0", "--config.train.log_every=6",
                      "--config.optim.lr=0.01", "--config.checkpoint.async=false"]) == 0
    return work


def test_a_char_run_goes_to_transformers_and_back_and_samples_the_same(tmp_path, capsys):
    """train (char) -> to_hf: a tokenizer.json AutoTokenizer loads with meshtrain's ids,
    end of text as bos/eos inside the vocabulary, no warning -> from_hf -> sample
    --checkpoint prints the text sample --workdir prints (greedy, the run's mesh)."""
    from transformers import AutoTokenizer

    from meshtrain.checkpoints import init_from
    from meshtrain.data.tokenizers import load_tokenizer
    work = _train_char_run(tmp_path)
    tok = load_tokenizer(work / "tokenizer.json")
    assert tok.name == "char" and tok.vocab_size < 30
    capsys.readouterr()
    convert.to_hf(work, tmp_path / "hf", say=lambda _: None)
    assert "warning" not in capsys.readouterr().err
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert config["vocab_size"] == tok.vocab_size
    for c in (config, generation):
        assert c["eos_token_id"] == c["bos_token_id"] == tok.eot_id == tok.vocab_size - 1
    theirs = AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = (tmp_path / "doc1.txt").read_text()[:200]
    assert theirs(text).input_ids == tok.encode(text).tolist() and theirs.eos_token_id == tok.eot_id

    convert.from_hf(tmp_path / "hf", tmp_path / "ckpt", say=lambda _: None)
    assert init_from.read(tmp_path / "ckpt").tokenizer == f"hf:{tmp_path / 'ckpt' / 'tokenizer'}"
    knobs = ["--prompt=the cat", "--temperature=0", "--max_new_tokens=40"]
    assert sample.main([f"--workdir={work}", *knobs]) == 0
    ours = capsys.readouterr().out
    assert sample.main([f"--checkpoint={tmp_path / 'ckpt'}", *knobs, "--mesh=data:8", "--layout=dp"]) == 0
    assert capsys.readouterr().out == ours and ours.startswith("the cat") and len(set(ours)) > 4, ours


def test_ids_outside_the_vocabulary_are_dropped():
    configs = [{"eos_token_id": 50256, "bos_token_id": 3, "pad_token_id": [1, 400]}, {"eos_token_id": None}]
    assert tokenizer_files.keep_in_vocabulary(configs, 300) == ["eos_token_id=50256", "pad_token_id=[1, 400]"]
    assert configs == [{"eos_token_id": None, "bos_token_id": 3, "pad_token_id": None}, {"eos_token_id": None}]
