"""A Hugging Face model's own tokenizer, offline: the `hf:DIR` kind of `data.tokenizer`.

DIR is a model directory (or a converted checkpoint's `tokenizer/`) holding either
  tokenizer.json    read with `tokenizers`, or
  tokenizer.model   in tiktoken's format (Meta's Llama 3 release: "base64 rank" lines),
                    read with tiktoken, with Llama 3's split pattern and special tokens.
End of text is the model's end-of-sequence token: `eos_token` of tokenizer_config.json,
else `eos_token_id` of generation_config.json or config.json. Unlike `bpe:PATH`, no
"<|endoftext|>" is added, so the ids stay inside the model's vocabulary.

`copy_files` puts a model directory's tokenizer into a converted checkpoint and returns
the spec that names it there.
"""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

from meshtrain.data.subword import BPETokenizer, GPT2Tokenizer
from meshtrain.errors import UserError

# Files of a Hugging Face tokenizer (tokenizer.json is the one read; the rest come along so
# an export is a complete model repository).
HF_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# Llama 3's pre-tokenizer split (Meta's tokenizer.py) and its 256 special tokens.
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
                  r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                  "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
                  "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
LLAMA3_SPECIAL += [f"<|reserved_special_token_{i}|>" for i in range(2, 256 - len(LLAMA3_SPECIAL) + 2)]


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except ValueError:
        return {}


def eos_token(directory: Path, id_to_token) -> str | None:
    """The end-of-sequence token a model directory names, or None."""
    eos = _json(directory / "tokenizer_config.json").get("eos_token")
    if isinstance(eos, dict):  # AddedToken serialised
        eos = eos.get("content")
    if isinstance(eos, str) and eos:
        return eos
    for name in ("generation_config.json", "config.json"):
        ids = _json(directory / name).get("eos_token_id")
        ids = ids if isinstance(ids, list) else [ids]
        if ids and isinstance(ids[0], int) and id_to_token(ids[0]) is not None:
            return id_to_token(ids[0])
    return None


def is_tiktoken_file(path: Path) -> bool:
    """Whether `path` is tiktoken's "base64 rank" format (a sentencepiece model is binary)."""
    try:
        with open(path, "rb") as f:
            token, rank = f.readline().split()
        base64.b64decode(token, validate=True)
        int(rank)
        return True
    except (OSError, ValueError):
        return False


class HFTokenizer(BPETokenizer):
    """A model's tokenizer.json with the model's own end-of-sequence token as end of text."""

    name = "hf"

    def __init__(self, hf, source: str, eot: str):
        # Not BPETokenizer.__init__: it would add "<|endoftext|>" when the vocabulary lacks it.
        if hf.token_to_id(eot) is None:
            raise UserError(f"The tokenizer {source} has no token {eot!r}, which its model "
                            f"names as end of sequence. Fix eos_token in tokenizer_config.json.")
        hf.encode_special_tokens = True  # literal special tokens in text are plain text
        self.hf, self.source, self.eot = hf, source, eot
        self.eot_id = hf.token_to_id(eot)
        self.vocab_size = max(hf.get_vocab(with_added_tokens=True).values()) + 1

    def to_json(self) -> dict:
        return {"kind": self.name, "eot": self.eot, "tokenizer": json.loads(self.hf.to_str())}

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(self.to_json()))

    def describe(self) -> str:
        return f"hf ({self.source}, {self.vocab_size} ids, end of text {self.eot!r})"


class TiktokenTokenizer(GPT2Tokenizer):
    """Meta's Llama 3 tokenizer.model (tiktoken ranks) with Llama 3's special tokens."""

    name = "hf"

    def __init__(self, ranks_text: str, source: str, eot: str = "<|end_of_text|>"):
        import tiktoken
        ranks = {}
        for line in ranks_text.splitlines():
            if line:
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
        special = {t: len(ranks) + i for i, t in enumerate(LLAMA3_SPECIAL)}
        if eot not in special:
            raise UserError(f"{source}: end of text {eot!r} is not one of Llama 3's special tokens.")
        # Not GPT2Tokenizer.__init__: it takes end of text from "<|endoftext|>".
        self.enc = tiktoken.Encoding(source, pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
                                     special_tokens=special)
        self.directory, self.vocab_size = None, self.enc.n_vocab
        self.ranks_text, self.source, self.eot = ranks_text, source, eot
        self.eot_id = special[eot]

    def to_json(self) -> dict:
        return {"kind": self.name, "eot": self.eot, "tiktoken": self.ranks_text}

    def describe(self) -> str:
        return f"hf ({self.source}, tiktoken, {self.vocab_size} ids, end of text {self.eot!r})"


def load(directory) -> HFTokenizer | TiktokenTokenizer:
    """The tokenizer of a model directory (see the module docstring)."""
    from tokenizers import Tokenizer
    d = Path(directory)
    if (d / "tokenizer.json").is_file():
        try:
            hf = Tokenizer.from_file(str(d / "tokenizer.json"))
        except Exception as e:  # the library raises a bare Exception for any bad field
            raise UserError(f"{d / 'tokenizer.json'} is not a Hugging Face tokenizer ({e}). "
                            f"Re-download it.") from None
        eot = eos_token(d, hf.id_to_token)
        if eot is None:
            eot = "<|endoftext|>" if hf.token_to_id("<|endoftext|>") is not None else None
        if eot is None:
            raise UserError(f"{d} names no end-of-sequence token (eos_token in "
                            f"tokenizer_config.json, or eos_token_id in config.json), which "
                            f"joins documents. Add eos_token to tokenizer_config.json.")
        return HFTokenizer(hf, str(d / "tokenizer.json"), eot)
    if (d / "tokenizer.model").is_file() and is_tiktoken_file(d / "tokenizer.model"):
        eot = eos_token(d, lambda _: None) or "<|end_of_text|>"  # by name; ids need the ranks
        return TiktokenTokenizer((d / "tokenizer.model").read_text(), str(d / "tokenizer.model"), eot)
    what = "does not exist" if not d.is_dir() else "has no tokenizer.json and no tiktoken tokenizer.model"
    raise UserError(f"The tokenizer directory {str(d)!r} {what}. Tokenizer 'hf:DIR' reads a "
                    f"Hugging Face model directory's tokenizer.json (or Meta's Llama 3 "
                    f"tokenizer.model); download it with the model.")


def from_json(spec: dict, where: str):
    """The tokenizer a `to_json()` dict describes (a saved dataset's tokenizer)."""
    from tokenizers import Tokenizer
    if "tiktoken" in spec:
        return TiktokenTokenizer(spec["tiktoken"], where, spec["eot"])
    return HFTokenizer(Tokenizer.from_str(json.dumps(spec["tokenizer"])), where, spec["eot"])


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
        config = _json(out / "tokenizer_config.json")
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


def write_hf_files(spec: str | None, out: Path) -> list[str]:
    """Puts the tokenizer a spec names into an exported model directory, in Hugging
    Face's names; returns the files written ([] when there is nothing to copy)."""
    if not spec or ":" not in spec:
        return []
    kind, _, arg = spec.partition(":")
    src = Path(arg)
    if kind == "bpe":
        shutil.copyfile(src, out / "tokenizer.json")
        return ["tokenizer.json"]
    pairs = {"gpt2": [("vocab.bpe", "merges.txt"), ("encoder.json", "vocab.json")],
             "hf": [(f, f) for f in (*HF_FILES, "vocab.json", "merges.txt", "tokenizer.model")]}.get(kind, [])
    written = []
    for a, b in pairs:
        if (src / a).is_file():
            shutil.copyfile(src / a, out / b)
            written.append(b)
    return written


def token_ids(spec: str | None) -> dict:
    """{"eos_token_id": end of text} for a config.json that lacks one, from the tokenizer
    a spec names ({} if it names none or cannot be read)."""
    if not spec:
        return {}
    from meshtrain.data.tokenizers import make_tokenizer
    try:
        return {"eos_token_id": int(make_tokenizer(spec).eot_id)}
    except (UserError, ValueError):  # ValueError: 'char' needs its corpus
        return {}
