"""A Hugging Face model's own tokenizer, offline: the `hf:DIR` kind of `data.tokenizer`.

DIR is a model directory (or a converted checkpoint's `tokenizer/`) holding either
  tokenizer.json    read with `tokenizers`, or
  tokenizer.model   in tiktoken's format (Meta's Llama 3 release: "base64 rank" lines),
                    read with tiktoken, with Llama 3's split pattern and special tokens.
End of text is the model's end-of-sequence token: `eos_token` of tokenizer_config.json,
else `eos_token_id` of generation_config.json or config.json. Unlike `bpe:PATH`, no
"<|endoftext|>" is added, so the ids stay inside the model's vocabulary.

Conversions copy these files with meshtrain.hf.tokenizer_files.
"""

from __future__ import annotations

import base64
import json
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


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except ValueError:
        return {}


def eos_token(directory: Path, id_to_token) -> str | None:
    """The end-of-sequence token a model directory names, or None."""
    eos = read_json(directory / "tokenizer_config.json").get("eos_token")
    if isinstance(eos, dict):  # AddedToken serialised
        eos = eos.get("content")
    if isinstance(eos, str) and eos:
        return eos
    for name in ("generation_config.json", "config.json"):
        ids = read_json(directory / name).get("eos_token_id")
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
        self.directory, self.vocab_size, self.special = None, self.enc.n_vocab, special
        self.ranks_text, self.source, self.eot = ranks_text, source, eot
        self.eot_id = special[eot]

    def to_json(self) -> dict:
        return {"kind": self.name, "eot": self.eot, "tiktoken": self.ranks_text}

    def describe(self) -> str:
        return f"hf ({self.source}, tiktoken, {self.vocab_size} ids, end of text {self.eot!r})"


def special_id(tok, token: str) -> int | None:
    """The id of special token `token` ("<|begin_of_text|>") in a model's tokenizer; None for
    another tokenizer or one without it."""
    if isinstance(tok, HFTokenizer):
        return tok.hf.token_to_id(token)
    if isinstance(tok, TiktokenTokenizer):
        return tok.special.get(token)
    return None


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
