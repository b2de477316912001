"""A model directory's tokenizer files in and out of meshtrain's conversions.

`copy_files` puts a Hugging Face model directory's tokenizer into a converted checkpoint
(`convert from_hf`) and returns the `data.tokenizer` spec that names it there;
`write_hf_files` and `token_ids` put a run's tokenizer, of any kind, into an exported
model directory (`convert to_hf`), and `keep_in_vocabulary` drops token ids that a
config would carry past the vocabulary. Reading a tokenizer is meshtrain.data's
(data/tokenizers.py, data/hf_tokenizer.py).

Every kind becomes a tokenizer.json that `tokenizers` and transformers' AutoTokenizer
load, with the same ids as meshtrain's tokenizer (`hf_tokenizer`):
  byte      a byte-level BPE without merges: ids 0..255 the bytes, 256 "<|endoftext|>"
  char      a BPE without merges whose tokens are the characters (ids as sorted), a Fuse
            decoder (no spaces between them), "<|endoftext|>" last
  bpe:PATH, hf:DIR (tokenizer.json)   its own tokenizer (end of text included)
  gpt2, hf:DIR (tiktoken tokenizer.model)   tiktoken's ranks as a byte-level BPE, the
            merges recovered from the ranks as transformers' TikTokenConverter does,
            with its split pattern and special tokens
beside a tokenizer_config.json naming end of text as eos_token. An hf:DIR model's own
files (tokenizer_config.json with its chat template, ...) are copied instead when DIR
still holds them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from meshtrain.data.hf_tokenizer import HF_FILES, is_tiktoken_file, load, read_json
from meshtrain.data.subword import EOT
from meshtrain.data.tokenizers import ByteTokenizer, CharTokenizer


def copy_files(model_dir: Path, out: Path) -> tuple[str | None, str]:
    """Copies a model directory's tokenizer into `out`; (spec relative to out's parent,
    what was copied). tokenizer.json wins; then GPT-2's vocab.bpe + encoder.json (or their
    Hugging Face names merges.txt + vocab.json); then a tiktoken tokenizer.model."""
    model_dir = Path(model_dir)
    if (model_dir / "tokenizer.json").is_file():
        out.mkdir(parents=True, exist_ok=True)
        copied = [f for f in (*HF_FILES, "vocab.json", "merges.txt") if (model_dir / f).is_file()]
        for f in copied:
            shutil.copyfile(model_dir / f, out / f)
        tok = load(model_dir)  # fails now, not at training time, if it cannot be read
        config = read_json(out / "tokenizer_config.json")
        if config.get("eos_token") is None:  # record what load() found, for the copy
            config["eos_token"] = tok.eot
            (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        return f"hf:{out.name}", f"{', '.join(copied)} ({tok.describe()})"
    for bpe, encoder in (("vocab.bpe", "encoder.json"), ("merges.txt", "vocab.json")):
        if (model_dir / bpe).is_file() and (model_dir / encoder).is_file():
            out.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(model_dir / bpe, out / "vocab.bpe")
            shutil.copyfile(model_dir / encoder, out / "encoder.json")
            return f"gpt2:{out.name}", f"{bpe} + {encoder} as GPT-2's vocab.bpe + encoder.json"
    for model in (model_dir / "tokenizer.model", model_dir / "original" / "tokenizer.model"):
        if model.is_file() and is_tiktoken_file(model):
            out.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(model, out / "tokenizer.model")
            return f"hf:{out.name}", f"{model.relative_to(model_dir)} (tiktoken, Llama 3 special tokens)"
    return None, "none (no tokenizer.json, GPT-2 vocab files or tiktoken tokenizer.model)"


def write_hf_files(tok, spec: str | None, out: Path) -> list[str]:
    """Writes tokenizer `tok` (read with the spec `spec`) into an exported model directory
    in Hugging Face's names; returns the files written. An hf:DIR spec's own files are
    copied when DIR holds them; tokenizer.json and tokenizer_config.json are written from
    `tok` where they are not."""
    kind, _, arg = (spec or "").partition(":")
    written = []
    if kind == "hf" and Path(arg).is_dir():
        for f in (*HF_FILES, "vocab.json", "merges.txt", "tokenizer.model"):
            if (Path(arg) / f).is_file():
                shutil.copyfile(Path(arg) / f, out / f)
                written.append(f)
    if {"tokenizer.json", "tokenizer_config.json"} <= set(written):
        return written
    hf = hf_tokenizer(tok)
    if "tokenizer.json" not in written:
        hf.save(str(out / "tokenizer.json"))
        written.append("tokenizer.json")
    if "tokenizer_config.json" not in written:
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": hf.id_to_token(int(tok.eot_id)),
                  "clean_up_tokenization_spaces": False}  # decode must not drop spaces
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        written.append("tokenizer_config.json")
    return written


def hf_tokenizer(tok):
    """A `tokenizers.Tokenizer` that encodes and decodes as meshtrain's `tok` (any kind,
    see the module docstring), end of text a special token at `tok.eot_id`."""
    from tokenizers import Tokenizer, decoders, models
    if hasattr(tok, "hf"):  # bpe:PATH and hf:DIR's tokenizer.json (a copy: tok keeps its own)
        return Tokenizer.from_str(tok.hf.to_str())
    if isinstance(tok, ByteTokenizer):
        return _byte_level({bytes([b]): b for b in range(256)}, None, {EOT: tok.eot_id})
    if isinstance(tok, CharTokenizer):
        # No pre-tokenizer: the text is one word, which BPE splits into its characters.
        hf = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(tok.chars)}, merges=[]))
        hf.decoder = decoders.Fuse()
        return _add_special(hf, {EOT: tok.eot_id})
    enc = tok.enc  # tiktoken (gpt2, hf:DIR's tokenizer.model)
    ranks = {b: enc.encode_single_token(b) for b in enc.token_byte_values()}
    special = {t: enc.encode_single_token(t) for t in enc.special_tokens_set}
    return _byte_level(ranks, enc._pat_str, special)  # no public name for the split pattern


def _byte_level(ranks: dict[bytes, int], pattern: str | None, special: dict[str, int]):
    """A byte-level BPE over `ranks` (token bytes -> id; lower ids merge first), its text
    split by `pattern` first (None: not split), with `special` tokens at their ids."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    char = _bytes_to_unicode()

    def name(token: bytes) -> str:
        return "".join(char[b] for b in token)
    merges = []
    for token, rank in ranks.items():  # every split of a token into two tokens, as tiktoken merges
        merges += sorted((rank, ranks[token[:i]], ranks[token[i:]], token[:i], token[i:])
                         for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks)
    hf = Tokenizer(models.BPE(vocab={name(t): r for t, r in ranks.items()},
                              merges=[(name(a), name(b)) for *_, a, b in sorted(merges)]))
    level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.pre_tokenizer = level if pattern is None else pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(pattern), behavior="isolated"), level])
    hf.decoder = decoders.ByteLevel()
    return _add_special(hf, special)


def _add_special(hf, special: dict[str, int]):
    """Adds `special` tokens (name -> id) in id order; each must land on its id."""
    from tokenizers import AddedToken
    for token, i in sorted(special.items(), key=lambda kv: kv[1]):
        hf.add_special_tokens([AddedToken(token, special=True, normalized=False)])
        if hf.token_to_id(token) != i:
            raise ValueError(f"special token {token!r} would get id {hf.token_to_id(token)}, not {i}")
    return hf


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which byte-level BPE tokens are spelt in."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    moved = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(moved)}}


def token_ids(tok) -> dict:
    """{"bos_token_id", "eos_token_id"} for a config.json that lacks them: end of text for
    both (documents start after it: GPT-2's convention, and where sampling starts an
    empty prompt), or None without a tokenizer: no id transformers would default to."""
    eot = None if tok is None else int(tok.eot_id)
    return {"bos_token_id": eot, "eos_token_id": eot}


def keep_in_vocabulary(configs: list[dict], vocab: int) -> list[str]:
    """Drops every *_token_id (an int or a list of them) outside [0, vocab) from each
    config, in place; returns what was dropped, as "key=value" strings."""
    dropped = []
    for config in configs:
        for key, value in list(config.items()):
            ids = value if isinstance(value, list) else [value]
            if key.endswith("_token_id") and value is not None and not all(
                    isinstance(i, int) and 0 <= i < vocab for i in ids):
                dropped.append(f"{key}={value}")
                config[key] = None
    return dropped
