"""Subword tokenizers: a Hugging Face byte-level BPE (loaded or trained here) and GPT-2.

Both wrap a fast library (Rust underneath) rather than reimplementing BPE: the
libraries' batch encoders run on all cores, which is what makes tokenizing a large
corpus cheap. The wrappers add only what meshtrain needs from every tokenizer:
int32 numpy ids, an end-of-text id (`eot_id`) for joining documents, JSON that
saves the exact vocabulary, and UserErrors for files that are missing or wrong.

Design points:
  * `encode` never adds special tokens, and a literal "<|endoftext|>" in user text
    is ordinary text, so only the data pipeline decides where documents end. tiktoken
    has `encode_ordinary` for this; Hugging Face tokenizers match added tokens before
    the model sees the text, whatever `add_special_tokens` says, so we set its
    `encode_special_tokens` flag, which makes special tokens encode as plain text
    (the flag is not saved in tokenizer.json, so saved files stay standard).
  * `decode` keeps special tokens, so an end of text shows as "<|endoftext|>".
  * Nothing here touches the network. tiktoken downloads GPT-2's files when its cache
    lacks them (and re-downloads a cached file whose hash is wrong), so we check the
    cache ourselves first and raise a UserError that says how to provide the files.
"""

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Iterable

import numpy as np

from meshtrain.errors import UserError

EOT = "<|endoftext|>"

# GPT-2's original files, as tiktoken_ext.openai_public.gpt2() fetches them: tiktoken
# caches each under sha1(url) and checks its sha256.
_GPT2_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"
_GPT2_FILES = {  # file name -> sha256 of its contents
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}


def _ids_list(ids) -> list[int]:
    """[n] ints (list or array, any int dtype) -> list of Python ints for the libraries."""
    return np.asarray(ids, np.int64).reshape(-1).tolist()


class BPETokenizer:
    """A Hugging Face `tokenizers.Tokenizer` (usually byte-level BPE) with an end of text."""

    name = "bpe"

    def __init__(self, hf, source: str):
        """hf: a tokenizers.Tokenizer; source: where it came from, for describe()."""
        self.source = source
        if hf.token_to_id(EOT) is None:
            # Documents must be joinable, so a vocabulary without the token gets it
            # as a new special token at the end (vocab_size grows by one).
            hf.add_special_tokens([EOT])
        # Makes a literal "<|endoftext|>" in text encode as ordinary text (see the
        # module docstring); not serialized, so save() writes a standard file.
        hf.encode_special_tokens = True
        self.hf = hf
        self.eot_id = hf.token_to_id(EOT)
        # max id + 1, not the count of tokens: ids stay in [0, vocab_size) even if
        # a hand-written file leaves holes in the id range.
        self.vocab_size = max(hf.get_vocab(with_added_tokens=True).values()) + 1

    @classmethod
    def from_file(cls, path) -> "BPETokenizer":
        """Loads a Hugging Face tokenizer.json; a missing or bad file is a UserError."""
        from tokenizers import Tokenizer  # lazy: importing it costs time
        path = Path(path)
        how = ("Point to a Hugging Face tokenizer.json (a model repository has one; "
               "`python -m meshtrain.data.prepare --train_bpe=N` trains one).")
        if path.is_dir():
            hint = (f" It has a tokenizer.json: use {str(path / 'tokenizer.json')!r}."
                    if (path / "tokenizer.json").is_file() else "")
            raise UserError(f"The BPE tokenizer path {str(path)!r} is a directory, not a "
                            f"tokenizer.json file.{hint} {how}")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            reason = "it does not exist" if not path.exists() else f"it cannot be read ({e})"
            raise UserError(f"Could not load the BPE tokenizer {str(path)!r}: {reason}. "
                            f"{how}") from None
        try:
            json.loads(text)
        except ValueError as e:
            raise UserError(f"Could not load the BPE tokenizer {str(path)!r}: it is not "
                            f"valid JSON ({e}). {how}") from None
        try:
            hf = Tokenizer.from_str(text)
        except Exception as e:  # the library raises a bare Exception for any bad field
            raise UserError(f"Could not load the BPE tokenizer {str(path)!r}: it is JSON "
                            f"but not a Hugging Face tokenizer ({e}). {how}") from None
        return cls(hf, source=path.name)

    def encode(self, text: str) -> np.ndarray:
        """str -> [n] int32 ids; no special tokens are added or matched."""
        return np.asarray(self.hf.encode(text, add_special_tokens=False).ids, np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """[b] str -> b arrays [n_i] int32, the same as encode, on all cores."""
        # encode_batch_fast skips offsets we never use (tokenizers >= 0.21).
        batch = getattr(self.hf, "encode_batch_fast", self.hf.encode_batch)
        return [np.asarray(e.ids, np.int32) for e in batch(list(texts), add_special_tokens=False)]

    def decode(self, ids) -> str:
        """[n] ints in [0, vocab_size) -> str; partial UTF-8 sequences become U+FFFD."""
        return self.hf.decode(_ids_list(ids), skip_special_tokens=False)

    def to_json(self) -> dict:
        """The Hugging Face tokenizer.json content (with the end-of-text token)."""
        return json.loads(self.hf.to_str())

    def save(self, path) -> None:
        """Writes tokenizer.json; `tokenizers.Tokenizer.from_file` reads it back."""
        self.hf.save(str(path))

    def describe(self) -> str:
        return f"bpe ({self.source}, {self.vocab_size} ids)"


def train_bpe(texts: Iterable[str], vocab_size: int) -> BPETokenizer:
    """Trains a GPT-2 style byte-level BPE of exactly `vocab_size` ids, offline.

    The alphabet is all 256 bytes, so any text encodes (no unknown token) and decode
    round-trips it; id 0 is "<|endoftext|>" (the trainer puts special tokens first),
    ids 1..256 are the bytes and the rest are merges, in the order they were learned.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    smallest = 256 + 1  # every byte, plus the end-of-text token
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < smallest:
        raise UserError(
            f"A byte-level BPE vocabulary needs at least {smallest} ids (256 bytes plus "
            f"{EOT}), but vocab_size is {vocab_size!r}. Ask for {smallest} or more; a few "
            f"thousand suits a small corpus, GPT-2 uses 50257.")
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(texts, trainer=trainer)
    got = hf.get_vocab_size(with_added_tokens=True)
    if got != vocab_size:
        # The trainer stops early when no pair of tokens repeats: the corpus is too
        # small (or too repetitive) for the vocabulary asked for.
        raise UserError(
            f"BPE training asked for {vocab_size} ids, but the corpus only supports "
            f"{got} ids: the 256 bytes, end of text and {got - smallest} merges, after "
            f"which no pair of tokens repeats. Train on more text, or ask for vocab_size <= {got}.")
    return BPETokenizer(hf, source="trained")


class GPT2Tokenizer:
    """tiktoken's GPT-2 encoding (50257 ids, end of text 50256), from files on disk."""

    name = "gpt2"

    def __init__(self, enc, directory):
        """enc: a tiktoken.Encoding; directory: its files' folder, or None (tiktoken cache)."""
        self.enc = enc
        self.directory = directory
        self.vocab_size = enc.n_vocab
        self.eot_id = enc.eot_token

    @classmethod
    def load(cls, directory=None) -> "GPT2Tokenizer":
        """From vocab.bpe and encoder.json in `directory`, or from tiktoken's cache.

        Never downloads: files that are missing (or, in the cache, damaged) are a
        UserError that says where to get them.
        """
        if directory is not None:
            return cls(_encoding_from_dir(Path(directory)), str(directory))
        cache_dir, missing = _gpt2_cache_status()
        if missing:
            names = "; ".join(f"{_GPT2_URL}{f} -> {_cache_name(f)}" for f in _GPT2_FILES)
            raise UserError(
                f"The gpt2 tokenizer needs GPT-2's vocab.bpe and encoder.json, and this "
                f"machine does not download. In tiktoken's cache ({cache_dir!r}) "
                f"{'; '.join(missing)}. Either put the two files in a directory DIR and "
                f"use tokenizer 'gpt2:DIR', or copy them into the cache directory (set by "
                f"TIKTOKEN_CACHE_DIR, else DATA_GYM_CACHE_DIR, else <tempdir>/data-gym-"
                f"cache) under their sha1 names. URL -> cache name: {names}.")
        import tiktoken
        return cls(tiktoken.get_encoding("gpt2"), None)

    def encode(self, text: str) -> np.ndarray:
        """str -> [n] int32 ids; "<|endoftext|>" in text is ordinary text."""
        return np.asarray(self.enc.encode_ordinary(text), np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """[b] str -> b arrays [n_i] int32, the same as encode, on several threads."""
        return [np.asarray(ids, np.int32) for ids in self.enc.encode_ordinary_batch(list(texts))]

    def decode(self, ids) -> str:
        """[n] ints in [0, vocab_size) -> str; partial UTF-8 sequences become U+FFFD."""
        return self.enc.decode(_ids_list(ids), errors="replace")

    def to_json(self) -> dict:
        return {"kind": self.name, "dir": self.directory}

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(self.to_json()))

    def describe(self) -> str:
        where = self.directory if self.directory is not None else "tiktoken cache"
        return f"gpt2 ({where}, {self.vocab_size} ids)"


def _cache_name(filename: str) -> str:
    """The name tiktoken's read_file_cached gives GPT-2's `filename`: sha1 of its URL."""
    return hashlib.sha1((_GPT2_URL + filename).encode()).hexdigest()


def _gpt2_cache_status() -> tuple[str, list[str]]:
    """(tiktoken's cache dir, why each GPT-2 file there is unusable; [] if both are fine)."""
    # The same lookup order as tiktoken.load.read_file_cached.
    cache_dir = os.environ.get("TIKTOKEN_CACHE_DIR")
    if cache_dir is None:
        cache_dir = os.environ.get(
            "DATA_GYM_CACHE_DIR", os.path.join(tempfile.gettempdir(), "data-gym-cache"))
    if cache_dir == "":  # tiktoken reads "" as "no cache": it would always download
        return "", ["caching is off (TIKTOKEN_CACHE_DIR or DATA_GYM_CACHE_DIR is '')"]
    problems = []
    for filename, sha256 in _GPT2_FILES.items():
        path = Path(cache_dir, _cache_name(filename))
        if not path.is_file():
            problems.append(f"{filename} is missing")
        elif hashlib.sha256(path.read_bytes()).hexdigest() != sha256:
            # tiktoken would delete it and download it again.
            problems.append(f"{filename} ({path.name}) has the wrong sha256, so it is "
                            f"damaged or not GPT-2's")
    return cache_dir, problems


@contextlib.contextmanager
def _tiktoken_cache_off():
    """Makes tiktoken read local files directly instead of through its cache.

    read_file_cached caches local paths too (keyed by sha1 of the path), and with no
    expected hash it then serves that copy forever, even after the file changes.
    """
    old = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = ""
    try:
        yield
    finally:
        if old is None:
            del os.environ["TIKTOKEN_CACHE_DIR"]
        else:
            os.environ["TIKTOKEN_CACHE_DIR"] = old


def _encoding_from_dir(directory: Path):
    """tiktoken.Encoding for GPT-2's data-gym files vocab.bpe and encoder.json in `directory`."""
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str
    how = (f"The directory must hold GPT-2's original vocab.bpe and encoder.json, from "
           f"{_GPT2_URL}vocab.bpe and {_GPT2_URL}encoder.json.")
    missing = [f for f in _GPT2_FILES if not (directory / f).is_file()]
    if missing:
        what = ("does not exist" if not directory.exists() else "is not a directory"
                if not directory.is_dir() else f"lacks {' and '.join(missing)}")
        raise UserError(f"The gpt2 tokenizer directory {str(directory)!r} {what}. {how} "
                        f"Or use tokenizer 'gpt2' to read them from tiktoken's cache.")
    try:
        encoder = json.loads((directory / "encoder.json").read_text(encoding="utf-8"))
        with _tiktoken_cache_off():
            ranks = data_gym_to_mergeable_bpe_ranks(
                str(directory / "vocab.bpe"), str(directory / "encoder.json"))
    except (OSError, ValueError, KeyError, AssertionError) as e:
        # AssertionError: the loader's check that encoder.json matches the merges.
        reason = str(e) or "encoder.json does not match the merges in vocab.bpe"
        raise UserError(f"Could not read GPT-2's files in {str(directory)!r}: {reason}. "
                        f"{how}") from None
    # GPT-2's encoder.json names the end-of-text id (50256); the next free id otherwise.
    eot = encoder.get(EOT, len(ranks))
    return tiktoken.Encoding("gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={EOT: eot})
