"""Tokenizers for local text: UTF-8 bytes, or the characters of the corpus.

Both turn text into int32 ids and back, vectorised with numpy so a large corpus
encodes in about the time it takes to read. A tokenizer saves itself as JSON
(`save(path)`, `load_tokenizer(path)`) so a later run (or a sampler) can reuse the
exact vocabulary of a training run.
"""

import json
from pathlib import Path

import numpy as np

from meshtrain.errors import UserError

TOKENIZERS = ("byte", "char")


class ByteTokenizer:
    """UTF-8 bytes; vocabulary 256. Any byte sequence is valid input to decode."""

    name = "byte"
    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        """str -> [n_bytes] int32."""
        return self.encode_bytes(text.encode("utf-8"))

    def encode_bytes(self, data: bytes) -> np.ndarray:
        """Raw bytes (any encoding) -> [n_bytes] int32."""
        return np.frombuffer(data, np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        """[n] ints -> str; sampled ids may not be valid UTF-8, so bad bytes become U+FFFD."""
        return np.asarray(ids, np.uint8).tobytes().decode("utf-8", errors="replace")

    def to_json(self) -> dict:
        return {"kind": self.name}

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(self.to_json()))


class CharTokenizer:
    """One id per character; the vocabulary is the sorted set of corpus characters."""

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
        return len(self.chars)

    def encode(self, text: str) -> np.ndarray:
        """str -> [n_chars] int32; characters outside the vocabulary are a UserError."""
        points = _code_points(text)
        ids = np.searchsorted(self._points, points)
        ids = np.minimum(ids, len(self._points) - 1)
        unknown = self._points[ids] != points
        if unknown.any():
            missing = sorted(set(text[i] for i in np.flatnonzero(unknown)[:1000]))
            raise UserError(
                f"The text has characters that the char vocabulary lacks: "
                f"{''.join(missing)[:40]!r} ({len(missing)} distinct). The vocabulary "
                f"has {self.vocab_size} characters, from the corpus it was built on. "
                f"Build the vocabulary from a corpus that includes these characters, "
                f"or use the byte tokenizer, which encodes any text.")
        return ids.astype(np.int32)

    def decode(self, ids) -> str:
        """[n] ints in [0, vocab_size) -> str."""
        ids = np.asarray(ids, np.int64)
        return "".join(self.chars[i] for i in ids)

    def to_json(self) -> dict:
        return {"kind": self.name, "chars": self.chars}

    def save(self, path) -> None:
        # ensure_ascii keeps the file readable anywhere; json escapes round-trip.
        Path(path).write_text(json.dumps(self.to_json()))


def load_tokenizer(path):
    """A tokenizer saved by `save(path)`."""
    spec = json.loads(Path(path).read_text())
    kind = spec.get("kind")
    if kind == "byte":
        return ByteTokenizer()
    if kind == "char":
        return CharTokenizer(spec["chars"])
    raise UserError(
        f"The tokenizer file {str(path)!r} names kind {kind!r}, which is not a known "
        f"tokenizer. Known tokenizers: {', '.join(TOKENIZERS)}. Point to a file "
        f"written by a tokenizer's save().")


def check_tokenizer_name(name) -> str:
    """The name, if it is a known tokenizer; else a UserError listing the known ones."""
    if name not in TOKENIZERS:
        raise UserError(
            f"Unknown tokenizer {name!r} in data.tokenizer. Known tokenizers: "
            f"{', '.join(TOKENIZERS)} ('byte' encodes UTF-8 bytes with a vocabulary "
            f"of 256; 'char' uses the set of characters in the corpus). Set "
            f"data.tokenizer to one of them.")
    return name


def _code_points(text: str) -> np.ndarray:
    """str -> [len(text)] uint32 Unicode code points, without a Python loop."""
    return np.frombuffer(text.encode("utf-32-le"), np.uint32)
