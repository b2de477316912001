"""Tokenizers: text <-> int32 ids, with an end-of-text id that joins documents.

Specs (the value of `data.tokenizer` and of `prepare --tokenizer`):
  byte      UTF-8 bytes: ids 0..255 are the bytes, 256 is end of text (257 ids).
  char      one id per character of the corpus (sorted), then end of text.
  bpe:PATH  a Hugging Face `tokenizer.json` (meshtrain.data.subword).
  bpe       only for `prepare --train_bpe=N`, which trains one on the corpus.
  gpt2      tiktoken's GPT-2 encoding, from files already on disk; `gpt2:DIR`
            reads `vocab.bpe` and `encoder.json` from DIR.
  hf:DIR    a Hugging Face model's own tokenizer (DIR/tokenizer.json, or Meta's Llama 3
            tiktoken tokenizer.model) with the model's end-of-sequence token as end of
            text (meshtrain.data.hf_tokenizer); converted checkpoints name it.

Every tokenizer has `name`, `vocab_size` (end of text included), `eot_id`,
`encode(text) -> [n] int32` (never adds special ids), `encode_batch(texts)`,
`decode(ids)`, `to_json()`, `save(path)` and `describe()`. A saved tokenizer
(`load_tokenizer(path)`) gives the same ids, so a dataset carries its tokenizer.
"""

import json
from pathlib import Path

import numpy as np

from meshtrain.errors import UserError

TOKENIZERS = ("byte", "char", "bpe:PATH", "gpt2", "gpt2:DIR", "hf:DIR")


class ByteTokenizer:
    """UTF-8 bytes 0..255, end of text 256; vocabulary 257."""

    name = "byte"
    vocab_size = 257
    eot_id = 256

    def encode(self, text: str) -> np.ndarray:
        """str -> [n_bytes] int32."""
        # surrogateescape: text decoded with it (any bytes) encodes back to the same bytes.
        return self.encode_bytes(text.encode("utf-8", errors="surrogateescape"))

    def encode_bytes(self, data: bytes) -> np.ndarray:
        """Raw bytes (any encoding) -> [n_bytes] int32."""
        return np.frombuffer(data, np.uint8).astype(np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        """[n] ints -> str; end of text is dropped, invalid UTF-8 becomes U+FFFD."""
        ids = np.asarray(ids)
        return ids[ids < 256].astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def to_json(self) -> dict:
        return {"kind": self.name}

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(self.to_json()))

    def describe(self) -> str:
        return "byte (256 bytes + end of text = 257 ids)"


class CharTokenizer:
    """One id per character, sorted by code point; end of text is the last id."""

    name = "char"

    def __init__(self, chars: str):
        if not chars:
            raise ValueError("a char tokenizer needs at least one character")
        self.chars = "".join(sorted(set(chars)))
        # Sorted code points: encoding is a searchsorted over this table.
        self._points = _code_points(self.chars)

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        return cls(text)

    @property
    def vocab_size(self) -> int:
        return len(self.chars) + 1

    @property
    def eot_id(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> np.ndarray:
        """str -> [n_chars] int32; characters outside the vocabulary are a UserError."""
        points = _code_points(text)
        ids = np.minimum(np.searchsorted(self._points, points), len(self._points) - 1)
        unknown = self._points[ids] != points
        if unknown.any():
            missing = sorted(set(text[i] for i in np.flatnonzero(unknown)[:1000]))
            raise UserError(
                f"The text has characters that the char vocabulary lacks: "
                f"{''.join(missing)[:40]!r} ({len(missing)} distinct). The vocabulary "
                f"has {len(self.chars)} characters, from the corpus it was built on. "
                f"Build the vocabulary from a corpus that includes these characters, "
                f"or use the byte tokenizer, which encodes any text.")
        return ids.astype(np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        """[n] ints in [0, vocab_size) -> str; end of text is dropped."""
        return "".join(self.chars[i] for i in np.asarray(ids, np.int64) if i < len(self.chars))

    def to_json(self) -> dict:
        return {"kind": self.name, "chars": self.chars}

    def save(self, path) -> None:
        # json escapes non-ASCII characters, so the file reads back exactly anywhere.
        Path(path).write_text(json.dumps(self.to_json()))

    def describe(self) -> str:
        return f"char ({len(self.chars)} characters + end of text = {self.vocab_size} ids)"


def check_tokenizer_spec(spec) -> str:
    """The spec, if its form is known (files are checked when loaded); else a UserError."""
    ok = isinstance(spec, str) and (
        spec in ("byte", "char", "gpt2") or
        (spec.startswith(("bpe:", "gpt2:", "hf:")) and spec.split(":", 1)[1] != ""))
    if not ok:
        raise UserError(
            f"Unknown tokenizer {spec!r} in data.tokenizer. Known tokenizers: 'byte' "
            f"(UTF-8 bytes, 257 ids), 'char' (the corpus's characters), 'bpe:PATH' (a "
            f"Hugging Face tokenizer.json; `python -m meshtrain.data.prepare "
            f"--train_bpe=N` trains one), 'gpt2' or 'gpt2:DIR' (tiktoken's GPT-2 "
            f"encoding from files on disk) and 'hf:DIR' (a Hugging Face model's tokenizer). "
            f"Set data.tokenizer to one of them.")
    return spec


def make_tokenizer(spec: str, corpus_text: str | None = None):
    """The tokenizer `spec` names; 'char' builds its vocabulary from `corpus_text`."""
    check_tokenizer_spec(spec)
    if spec == "byte":
        return ByteTokenizer()
    if spec == "char":
        if not corpus_text:
            raise ValueError("the char tokenizer needs the corpus text to build its vocabulary")
        return CharTokenizer.from_text(corpus_text)
    from meshtrain.data import subword  # lazy: tokenizers and tiktoken import slowly
    kind, _, arg = spec.partition(":")
    if kind == "bpe":
        return subword.BPETokenizer.from_file(arg)
    if kind == "hf":
        from meshtrain.data import hf_tokenizer
        return hf_tokenizer.load(arg)
    return subword.GPT2Tokenizer.load(arg or None)


def from_json(spec: dict, where: str):
    """The tokenizer a `to_json()` dict (or a Hugging Face tokenizer.json) describes."""
    kind = spec.get("kind") if isinstance(spec, dict) else None
    if kind == "byte":
        return ByteTokenizer()
    if kind == "char":
        return CharTokenizer(spec["chars"])
    if kind == "gpt2":
        from meshtrain.data import subword
        return subword.GPT2Tokenizer.load(spec.get("dir"))
    if kind == "hf":
        from meshtrain.data import hf_tokenizer
        return hf_tokenizer.from_json(spec, where)
    if isinstance(spec, dict) and "model" in spec:
        from meshtrain.data import subword
        return subword.BPETokenizer.from_file(where)
    raise UserError(
        f"The tokenizer file {where!r} is neither a meshtrain tokenizer (a JSON object with "
        f"'kind' byte, char, gpt2 or hf) nor a Hugging Face tokenizer.json. Point to a file "
        f"written by a tokenizer's save(), or by `python -m meshtrain.data.prepare`.")


def load_tokenizer(path):
    """A tokenizer saved by `save(path)`, or any Hugging Face tokenizer.json."""
    path = Path(path)
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(
            f"Could not read the tokenizer file {str(path)!r}: {e}. It should be the "
            f"tokenizer.json that `python -m meshtrain.data.prepare` writes beside a "
            f"dataset; prepare the dataset again if it is missing or damaged.") from None
    return from_json(spec, str(path))


def _code_points(text: str) -> np.ndarray:
    """str -> [len(text)] uint32 Unicode code points, without a Python loop."""
    return np.frombuffer(text.encode("utf-32-le"), np.uint32)
